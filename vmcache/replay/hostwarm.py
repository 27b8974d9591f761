"""Host mode's restart: every VM back at once from the set its first run saved, the warm-ups paced (pure).

A host reboot starts every VM within seconds, and every agent restores its
saved set while the guests boot and read the same device. The VMs' first
run together (vmcache.replay.host's ``benefit`` arm, the agents' split of
the cap) is their cold start; at its end each VM saves its set as the
single-trace ``warm`` arm does (vmcache.replay.sim: the blocks its guest
read most, up to its budget, through the record the agent saves). The
second run starts every VM from its set at the same moment, paced two ways:

- ``shared``: one warm-up budget for the host's device, ``warm_rate`` bytes
  per second, divided every cycle as the agents divide it through
  vmcache.host.warmpool - the same pure rule (vmcache.model.warmshare:
  :func:`~vmcache.model.warmshare.warm_ask`, :class:`~vmcache.model.warmshare.DeviceBudget`:
  the densest saved region first, what a cycle did not read given back) -
  each VM's cycle paying its restore with the grant alone, its own
  ``prefetch_rate`` its other new pins (``Cycle.warm_allowance``), as the engine does. The
  VMs ask in ``--vm`` order at each cycle's end, each after the step
  before it, as agents whose cycles all end at the same moment would;
- ``per-agent``: each VM's cycle restores at ``warm_rate`` of its own, as
  every agent did before the host had one budget.

The replay does not model the device: a load costs no time, whatever the
rates add up to. So ``per-agent`` shows what that pacing asks of the device
(bytes per second, all VMs), not what a saturated device would do to the
guests' reads, and both arms' device reads are those of a device that keeps
up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ..model.cycle import Cycle
from ..model.params import ModelParams
from ..model.warm import WarmStart
from ..model.warmshare import DeviceBudget, warm_ask
from .host import HostVm, Merged, Restart, prepare, run_split
from .loads import WASTE_HORIZON, Loads, read_within
from .sim import cycle_hotset, saved_hotset

__all__ = ["PACINGS", "HEADS", "MOST", "RestartVm", "RestartResult", "SharedBudget", "replay_restart"]

SHARED, PER_AGENT = "shared", "per-agent"
PACINGS = (SHARED, PER_AGENT)
HEADS = (60.0, 300.0)
"""Seconds from the restart over which each VM's device reads are counted."""
MOST = 0.9
"""The share of a saved set whose restore :attr:`RestartVm.most_s` times."""


@dataclass
class _Progress:
    """One VM's restore as the cycles see it (seconds from the restart)."""

    saved: int
    restored: int = 0
    given_up: int = 0
    done_at: float | None = None
    most_at: float | None = None


class _Watch:
    """Follows each VM's restore (the per-agent pacing: nothing paid from a host budget)."""

    def __init__(self, t0: float, warm: dict[str, WarmStart]) -> None:
        self.t0 = t0
        self.progress = {name: _Progress(w.total_bytes) for name, w in warm.items()}

    def before(self, name: str, cycle: Cycle, now: float) -> None:
        """Nothing to ask: the cycle's bucket fills at its own ``warm_rate``."""

    def after(self, name: str, cycle: Cycle, now: float) -> None:
        """Nothing to give back."""

    def pinned(self, name: str, cycle: Cycle, now: float) -> None:
        warm, p = cycle.warm, self.progress.get(name)
        if warm is None or p is None:
            return
        p.restored, p.given_up = warm.restored_bytes, warm.given_up_bytes
        if p.most_at is None and (warm.done or p.restored >= MOST * p.saved):
            p.most_at = now - self.t0
        if warm.done and p.done_at is None:
            p.done_at = now - self.t0


class SharedBudget(_Watch):
    """The host's one warm-up budget of ``rate`` bytes per second, asked as the agents ask it (burst: one
    interval's worth, as the agents' pool holds)."""

    def __init__(self, t0: float, warm: dict[str, WarmStart], rate: int, params: ModelParams) -> None:
        super().__init__(t0, warm)
        self.rate, self.burst = float(rate), params.interval
        self.device = DeviceBudget.full(self.rate, self.burst, t0)

    def before(self, name: str, cycle: Cycle, now: float) -> None:
        """What :class:`~vmcache.service.warmbudget.WarmBudget` does before the engine's step."""
        ask = warm_ask(cycle.warm, cycle.params, self.rate)
        if ask is None:
            cycle.warm_allowance = None
            self.device.asks.pop(name, None)  # done: its ask goes (the agents' forget)
            return
        cycle.warm_allowance = self.device.take(name, *ask, now, rate=self.rate, burst=self.burst)

    def after(self, name: str, cycle: Cycle, now: float) -> None:
        """What the step did not spend goes back (the engine's settle)."""
        if cycle.warm_allowance is not None:
            self.device.give_back(name, cycle.bucket.unspent, rate=self.rate, burst=self.burst)


@dataclass(frozen=True)
class RestartVm:
    """One VM's restart: its saved set, when it was back, device reads against its cold start, its loads."""

    name: str
    saved_bytes: int
    restored_bytes: int
    given_up_bytes: int
    done_s: float | None
    """Seconds from the restart until every saved region was restored or given up (None: not by the end)."""
    most_s: float | None
    """Seconds from the restart until 90% of the set was restored (or its restore ended)."""
    reads: dict[float, int]
    """Device reads (guest misses) over the first ``h`` seconds, per ``h`` of :data:`HEADS`."""
    cold_reads: dict[float, int]
    """The same of its cold start (the first run)."""
    restore_loaded_bytes: int
    """What its pins loaded until its set was back (the whole run when it never was)."""
    restore_unread_bytes: int
    """Of those, bytes the guest did not read within 5 minutes of their load (waste)."""
    loaded_per_cycle: tuple[int, ...]
    """Bytes its pins loaded at the restart's first cycle and each one after (the device's share it took)."""

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "saved_bytes": self.saved_bytes, "restored_bytes": self.restored_bytes,
                "given_up_bytes": self.given_up_bytes, "done_s": self.done_s, "most_s": self.most_s,
                **{f"device_reads_{h:g}s": n for h, n in self.reads.items()},
                **{f"cold_device_reads_{h:g}s": n for h, n in self.cold_reads.items()},
                "restore_loaded_bytes": self.restore_loaded_bytes, "restore_unread_bytes": self.restore_unread_bytes,
                "loaded_per_cycle_bytes": list(self.loaded_per_cycle)}


@dataclass(frozen=True)
class RestartResult:
    """One pacing of the restart at one cap."""

    pacing: str
    cap: int
    warm_rate: int
    interval: float
    vms: list[RestartVm] = field(default_factory=list)

    @property
    def last_done_s(self) -> float | None:
        """When the last VM's restore ended (None: one never did)."""
        return _last([vm.done_s for vm in self.vms if vm.saved_bytes])

    @property
    def last_most_s(self) -> float | None:
        """When the last VM had 90% of its set back (None: one never had)."""
        return _last([vm.most_s for vm in self.vms if vm.saved_bytes])

    def host_loaded_per_cycle(self) -> tuple[int, ...]:
        """Bytes all VMs' pins loaded per cycle: what the device was asked for."""
        width = max((len(vm.loaded_per_cycle) for vm in self.vms), default=0)
        return tuple(int(sum(vm.loaded_per_cycle[c] for vm in self.vms if c < len(vm.loaded_per_cycle)))
                     for c in range(width))

    def to_json(self) -> dict[str, Any]:
        return {"pacing": self.pacing, "cap_bytes": self.cap, "warm_rate": self.warm_rate,
                "interval_s": self.interval, "last_done_s": self.last_done_s, "last_most_s": self.last_most_s,
                "host_loaded_per_cycle_bytes": list(self.host_loaded_per_cycle()),
                "vms": [vm.to_json() for vm in self.vms]}


def _last(times: list[float | None]) -> float | None:
    return None if any(t is None for t in times) else max((t for t in times if t is not None), default=0.0)


def replay_restart(vms: list[HostVm], caps: list[int], *, block_size: int, warm_rate: int, prefetch_rate: int,
                   params: ModelParams | None = None, memory: int | None = None, rest: str = "linux",
                   cache_unit: int | None = None, exact: bool = True,
                   pacings: tuple[str, ...] = PACINGS) -> list[RestartResult]:
    """Every pacing at every cap: the VMs' cold first run, then their restart from the sets it saved.

    ``memory``: the host page cache (default twice the cap); ``warm_rate``:
    the host's warm-up budget (``shared``) or each VM's own rate
    (``per-agent``), bytes per second; ``prefetch_rate``: each VM's, as the
    agents' (a restart without one loads for free: nothing to pace).
    Raises ValueError as :func:`~vmcache.replay.host.replay_host` does, and
    for an unknown pacing or a rate not above 0.
    """
    unknown = set(pacings) - set(PACINGS)
    if unknown:
        raise ValueError(f"unknown pacings: {', '.join(sorted(unknown))} (known: {', '.join(PACINGS)})")
    if warm_rate <= 0 or prefetch_rate <= 0:
        raise ValueError("a restart is paced: warm_rate and prefetch_rate must be above 0")
    p, merged = prepare(vms, block_size, params, cache_unit)
    t0 = float(merged.bt.time[0]) if len(merged.bt) else 0.0
    out = []
    for cap in caps:
        mem = memory if memory is not None else 2 * cap
        if cap > mem:
            raise ValueError(f"cap {cap} is more than the memory {mem}")
        split = ("benefit", merged, vms, cap, mem // merged.bt.block_size, p, rest, prefetch_rate, True, exact)
        cold, states, _ = run_split(*split)
        sets = {s.vm.name: (*cycle_hotset(s.cycle, budget=s.vm.budget, size_bytes=s.size), s.size) for s in states}
        for pacing in pacings:
            warm = {name: saved_hotset(hot, first, p, size) for name, (hot, first, size) in sets.items()}
            hook = SharedBudget(t0, warm, warm_rate, p) if pacing == SHARED else _Watch(t0, warm)
            hits, _, loads = run_split(*split, Restart(warm, hook, None if pacing == SHARED else warm_rate))
            out.append(RestartResult(pacing, cap, warm_rate, p.interval,
                                     [_figures(merged, i, vm.name, hits, cold, loads, hook, p.interval)
                                      for i, vm in enumerate(vms)]))
    return out


def _figures(merged: Merged, i: int, name: str, hits: NDArray[np.bool_], cold: NDArray[np.bool_], loads: Loads,
             watch: _Watch, interval: float) -> RestartVm:
    """VM ``i``'s figures of one restart (``hits``) beside its cold start (``cold``)."""
    bt, t0 = merged.bt, watch.t0
    mine = merged.vm == i
    p = watch.progress[name]

    def head(hit: NDArray[np.bool_], h: float) -> int:
        return int((bt.costly & ~hit & mine & (bt.time < t0 + h)).sum())

    times, units = loads.arrays()
    own = (np.searchsorted(merged.offsets, units, side="right") - 1) == i
    restore = own & (times <= t0 + (p.done_at if p.done_at is not None else np.inf))
    unread = ~read_within(bt, times[restore], units[restore], WASTE_HORIZON)
    cycle = np.rint((times[own] - t0) / interval).astype(np.int64)
    per_cycle = np.bincount(cycle, minlength=1) * bt.block_size if cycle.size else np.zeros(1, np.int64)
    return RestartVm(name, p.saved, p.restored, p.given_up, p.done_at, p.most_at, {h: head(hits, h) for h in HEADS},
                     {h: head(cold, h) for h in HEADS}, int(restore.sum()) * bt.block_size,
                     int(unread.sum()) * bt.block_size, tuple(int(b) for b in per_cycle))

