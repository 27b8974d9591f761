"""The agent's budget each cycle: its disks' budgets, memory pressure and the host-wide cap.

:class:`Budget` reads the host (PSI, MemTotal for a cap given as a share of
RAM) and keeps the domain's entries in the shared :class:`~vmcache.host.ledger.Ledger`:
each cycle it publishes the domain's demand curve (its disks' plans at the
full budget, from the previous cycle), takes its grant of the cap divided by
benefit (vmcache.model.share) and divides that between its disks; the
arithmetic is :mod:`vmcache.model.budget`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..errors import VmcacheError
from ..host.ledger import Ledger
from ..host.meminfo import MemInfo, MemoryPressure
from ..logfmt import event
from ..model.budget import divide_disks, domain_curve, next_share
from ..model.share import Curve, Demand
from ..settings.config import PinnedCap

__all__ = ["Budget", "Grant"]


#: A grant moves only when the split moves it by more than this share of the cap (hysteresis).
QUANTUM_SHARE = 1 / 100


@dataclass(frozen=True)
class Grant:
    """One cycle's allotment: what the domain wanted, what the cap granted, each disk's bytes.

    ``want``: the budget in force (metadata budget times the PSI share);
    ``demand``: the bytes its demand curve asks for; ``target``: its grant in
    the host's split; ``granted``: what it may pin now (``target``, or less
    while other agents still unpin); ``cap``: the host cap (None: none);
    ``error``: what the split reported (the minimums exceed the cap).
    """

    want: int
    granted: int
    share: float
    disks: Mapping[str, int]
    demand: int = 0
    target: int = 0
    minimum: int = 0
    cap: int | None = None
    error: str | None = None

    @property
    def backing_off(self) -> bool:
        """True while memory pressure holds the domain under its budget."""
        return self.share < 1.0


class Budget:
    """One domain's share of its budget and of the host-wide cap, cycle by cycle."""

    def __init__(self, domain: str, ledger: Ledger, *, cap: PinnedCap, psi_threshold: float,
                 pressure: Callable[[], MemoryPressure | None], meminfo: Callable[[], MemInfo],
                 logger: logging.Logger) -> None:
        self.domain = domain
        self._ledger = ledger
        self._cap = cap
        self._threshold = psi_threshold
        self._pressure = pressure
        self._meminfo = meminfo
        self._log = logger
        self.share = 1.0  # of the budget, shrunk under memory pressure (PSI)
        self.minimum = 0  # guaranteed bytes of the cap (metadata min=)
        self._target: int | None = None

    def grant(self, budgets: Mapping[str, int], curves: Mapping[str, Curve], *, held: int,
              total: int | None = None) -> Grant:
        """Publish the demand, take this cycle's share of the cap, divide it between the disks.

        ``budgets``: the most each disk may pin; ``total``: the most they
        may pin together (default: the sum); ``curves``: each disk's demand
        curve from its last cycle (empty before the first); ``held``: bytes
        the disks hold pinned now. Raises HostError (ledger, meminfo).
        """
        cap = self._cap.bytes_for(self._meminfo().total_bytes)
        self._ledger.cap = cap
        share = self._update_share()
        whole = sum(budgets.values())
        want = int((whole if total is None else min(total, whole)) * share)
        curve = domain_curve(budgets, share, curves)
        demand = Demand(budget=want, minimum=min(self.minimum, want), curve=curve)
        host = self._ledger.divide(self.domain, demand, held=held,
                                   quantum=0 if cap is None else int(cap * QUANTUM_SHARE))
        target = host.split.grants[self.domain]
        if target != self._target:
            self._log.info(event("share.grant", target=target, granted=host.granted, want=want,
                                 demand=demand.demand_bytes, cap=cap))
            self._target = target
        if host.split.error:
            self._log.warning(event("share.minimums_over_cap", error=host.split.error))
        return Grant(want, host.granted, share, divide_disks(budgets, share, host.granted, curves),
                     demand=demand.demand_bytes, target=target, minimum=demand.minimum, cap=cap,
                     error=host.split.error)

    def hold(self, pinned: int) -> None:
        """Record what the domain really holds after its cycle. Raises HostError."""
        self._ledger.reserve(self.domain, pinned)

    def release(self) -> None:
        """Give the domain's share back (the agent stops). Raises HostError."""
        self._ledger.release(self.domain)

    def _update_share(self) -> float:
        try:
            psi = self._pressure()
        except VmcacheError as err:
            self._log.warning(event("psi.unreadable", error=err))
            return self.share
        level = psi.some.avg10 if psi is not None else 0.0
        before, self.share = self.share, next_share(self.share, level, self._threshold)
        if self.share != before:
            self._log.info(event("psi.share", psi_some_avg10=level, threshold=self._threshold,
                                 share=f"{self.share:g}"))
        return self.share
