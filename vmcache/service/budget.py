"""The agent's budget each cycle: its disks' budgets, memory pressure and the host-wide cap.

:class:`Budget` reads the host (PSI, MemTotal for a cap given as a share of
RAM) and keeps the domain's entry in the shared :class:`~vmcache.host.ledger.Ledger`;
the arithmetic is :mod:`vmcache.model.budget`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..errors import VmcacheError
from ..host.ledger import Ledger
from ..host.meminfo import MemInfo, MemoryPressure
from ..logfmt import event
from ..model.budget import next_share, prorate
from ..settings.config import PinnedCap

__all__ = ["Budget", "Grant"]


@dataclass(frozen=True)
class Grant:
    """One cycle's allotment: what the domain wanted, what the cap granted, each disk's bytes."""

    want: int
    granted: int
    share: float
    disks: Mapping[str, int]

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

    def grant(self, budgets: Mapping[str, int]) -> Grant:
        """Reserve this cycle's bytes for disks with these ``budgets``. Raises HostError (ledger, meminfo)."""
        self._ledger.cap = self._cap.bytes_for(self._meminfo().total_bytes)
        share = self._update_share()
        want = int(sum(budgets.values()) * share)
        granted = self._ledger.reserve(self.domain, want)
        return Grant(want, granted, share, {disk: prorate(b, share, want, granted) for disk, b in budgets.items()})

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
