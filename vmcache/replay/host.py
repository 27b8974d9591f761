"""Host mode of the replay: several VMs' traces against one page cache and one pinned cap (pure).

Each VM has its own trace, image and metadata budget (the most it may pin)
and optionally a guaranteed minimum. All VMs share the host's page cache of
``memory`` bytes, of which at most ``cap`` bytes may be pinned (the host's
``pinned_cap``). The traces are merged in time order (ties: VM order) and
replayed through these arms, all at the same memory:

- ``lru``: one shared LRU of ``memory`` (no vmcache);
- ``linux``: one shared cache of ``memory`` with the kernel's lists
  (:class:`~vmcache.replay.baselines.LinuxCache`: the host without vmcache);
- ``first-come``, ``equal``, ``proportional``, ``benefit``: vmcache on every
  VM, each VM's pins within its grant, the unpinned rest of the memory one
  shared cache of the ``rest`` policy (the kernel's lists by default).
  Grants: ``first-come`` - in VM order, each its budget while
  the cap lasts (what the ledger did before issue 14, VMs starting in that
  order); ``equal`` - the cap shared equally, nobody above its budget (the
  surplus re-shared); ``proportional`` - in proportion to the budgets;
  ``benefit`` - every interval, :func:`vmcache.model.share.split` of the
  VMs' demand curves (their plans at the full budget), as the agents do
  through the ledger.

Every VM runs what the engine runs (:class:`vmcache.model.cycle.Cycle`, with
its reads counted exactly, as the single-trace replay's ``vmcache`` arm
does) at the end of each interval, under its grant; pinned blocks leave the
shared rest (or are loaded), released ones go back to it. In the ``benefit`` arm
each VM's demand curve after its step feeds the split whose grants the next
cycle runs under - the one-cycle lag of the agents, which divide through
the ledger at the start of a cycle. Deterministic: same traces, same results.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray

from ..model.blocks import blocks_of
from ..model.cycle import Cycle
from ..model.params import ModelParams
from ..model.region import Region
from ..model.share import Demand, demand_of, split
from ..model.warm import WarmStart
from . import sampling
from .accesses import BlockTrace, cycle_ends, to_blocks
from .baselines import linux, lru, rest_cache
from .loads import Loads, read_within
from .measures import PolicyResult, loads_extra, measure
from .sim import Memory
from .trace import Trace

__all__ = ["HostVm", "HostResult", "ARMS", "SPLITS", "Merged", "Restart", "RestartHook", "prepare", "run_split",
           "static_grants", "replay_host"]

SPLITS = ("first-come", "equal", "proportional", "benefit")
SHARED = {"lru": lru, "linux": linux}
ARMS = ("lru", "linux") + SPLITS


@dataclass(frozen=True)
class HostVm:
    """One VM of the host: its trace, budget (bytes), guaranteed minimum and image size (default: trace end)."""

    name: str
    trace: Trace
    budget: int
    minimum: int = 0
    size_bytes: int | None = None


@dataclass(frozen=True)
class HostResult:
    """One arm at one cap: the aggregate over all VMs (``total``) and each VM's figures."""

    arm: str
    cap: int
    memory: int
    total: PolicyResult
    vms: dict[str, PolicyResult]
    grant_mean: dict[str, float] = field(default_factory=dict)   # bytes, over the intervals
    pinned_mean: dict[str, float] = field(default_factory=dict)  # bytes, over the intervals

    def to_json(self) -> dict[str, object]:
        return {"arm": self.arm, "cap_bytes": self.cap, "memory_bytes": self.memory,
                **{k: v for k, v in self.total.to_json().items() if k not in ("policy", "budget_bytes")},
                "vms": {n: {**{k: v for k, v in r.to_json().items() if k not in ("policy", "budget_bytes")},
                            "grant_mean_bytes": round(self.grant_mean.get(n, 0.0)),
                            "pinned_mean_bytes": round(self.pinned_mean.get(n, 0.0))}
                        for n, r in self.vms.items()}}


def static_grants(how: str, vms: list[HostVm], cap: int) -> dict[str, int]:
    """The fixed grants of the ``first-come``, ``equal`` and ``proportional`` splits. ValueError for others."""
    if how == "first-come":
        grants, left = {}, cap
        for vm in vms:
            grants[vm.name] = min(vm.budget, left)
            left -= grants[vm.name]
        return grants
    if how == "equal":  # equal water-filling: split() with no curves shares the cap equally up to budgets
        return split({vm.name: Demand(budget=vm.budget) for vm in vms}, cap).grants
    if how == "proportional":
        total = sum(vm.budget for vm in vms)
        return {vm.name: vm.budget if total <= cap else vm.budget * cap // total for vm in vms}
    raise ValueError(f"not a static split: {how!r}")


class RestartHook(Protocol):
    """What a restart runs around each VM's cycle (vmcache.replay.hostwarm): before its step, after it,
    and once the step's regions are pinned."""

    def before(self, name: str, cycle: Cycle, now: float) -> None: ...

    def after(self, name: str, cycle: Cycle, now: float) -> None: ...

    def pinned(self, name: str, cycle: Cycle, now: float) -> None: ...


@dataclass(frozen=True)
class Restart:
    """A split arm's run as a restart: each VM's cycle starts from ``warm[name]`` (a first cycle at the
    start seeds it, as an agent's does), restores at ``warm_rate`` of its own unless ``hook`` pays it."""

    warm: Mapping[str, WarmStart]
    hook: RestartHook
    warm_rate: int | None = None


@dataclass
class _Vm:
    """One VM's cycle and pins in a split arm (model blocks are the VM's own, 0-based; ``offset`` in units)."""

    vm: HostVm
    index: int
    offset: int
    units: int
    size: int
    cycle: Cycle
    pinned: NDArray[np.int64]
    current: list[Region] = field(default_factory=list)
    granted: int = 0
    grant_sum: float = 0.0
    pinned_sum: float = 0.0


@dataclass
class Merged:
    """All VMs' accesses in time order, in one space of cache units (VM i's from ``offsets[i]``)."""

    bt: BlockTrace
    vm: NDArray[np.int64]
    offsets: list[int]
    sizes: list[int]
    units: list[int]  # each VM's, a whole number of model blocks


def _merge(vms: list[HostVm], unit: int, per: int) -> Merged:
    parts = [to_blocks(vm.trace, unit, vm.size_bytes) for vm in vms]
    units = [-(-p.nblocks // per) * per for p in parts]  # a VM's model blocks start at a block boundary
    offsets = np.cumsum([0] + units)[:-1].tolist()
    requests = np.cumsum([0] + [int(p.request[-1]) + 1 if len(p) else 0 for p in parts])[:-1].tolist()
    order = np.argsort(np.concatenate([p.time for p in parts]), kind="stable")  # ties keep VM order

    def joined(name: str, shift: list[int] | None = None) -> NDArray[Any]:
        arrays = [getattr(p, name) + shift[i] if shift else getattr(p, name) for i, p in enumerate(parts)]
        return np.concatenate(arrays)[order]

    which = np.concatenate([np.full(len(p), i, dtype=np.int64) for i, p in enumerate(parts)])[order]
    bt = BlockTrace(joined("block", offsets), joined("time"), joined("write"), unit,
                    sum(units), joined("pages"), joined("costly"), joined("request", requests))
    sizes = [vm.size_bytes if vm.size_bytes is not None else p.nblocks * unit for vm, p in zip(vms, parts)]
    return Merged(bt, which, offsets, sizes, units)


def _results(arm: str, cap: int, memory: int, merged: Merged, vms: list[HostVm], hits: NDArray[np.bool_],
             loads: Loads | None = None) -> tuple[PolicyResult, dict[str, PolicyResult]]:
    """The arm's figures over all VMs and per VM; ``loads``: what the VMs' pins loaded (split arms)."""
    bt = merged.bt
    if loads is None:
        used, owner = None, None
    else:
        times, units = loads.arrays()
        used = read_within(bt, times, units)
        owner = np.searchsorted(merged.offsets, units, side="right") - 1

    def extra(select: int | None, requests: int) -> dict[str, Any]:
        if used is None:
            return {}
        return loads_extra(used if select is None else used[owner == select], requests)

    total = measure(arm, cap, bt, hits, memory_bytes=memory, **extra(None, bt.requests()))
    per_vm = {}
    for i, vm in enumerate(vms):
        mine = merged.vm == i
        per_vm[vm.name] = measure(arm, cap, bt, hits, select=mine, memory_bytes=memory,
                                  **extra(i, bt.requests(mine)))
    return total, per_vm


def prepare(vms: list[HostVm], block_size: int, params: ModelParams | None,
            cache_unit: int | None) -> tuple[ModelParams, Merged]:
    """Every VM's model (``params`` at ``block_size``) and their accesses merged in time order, in units of
    ``cache_unit`` (default the block). Raises ValueError for no VMs, duplicate names or a cache unit that
    does not divide the block."""
    if not vms:
        raise ValueError("no VMs")
    if len({vm.name for vm in vms}) != len(vms):
        raise ValueError("VM names must be unique")
    p = ModelParams(**{**(params or ModelParams()).__dict__, "block_size": block_size})
    unit = block_size if cache_unit is None else cache_unit
    if unit < 1 or block_size % unit:
        raise ValueError(f"cache unit {unit} does not divide the block size {block_size}")
    return p, _merge(vms, unit, block_size // unit)


def replay_host(vms: list[HostVm], caps: list[int], *, block_size: int, params: ModelParams | None = None,
                memory: int | None = None, memory_factor: float = 2.0,
                arms: tuple[str, ...] = ARMS, rest: str = "linux",
                prefetch_rate: int | None = None, cache_unit: int | None = None, fill: bool = True,
                exact: bool = False) -> list[HostResult]:
    """Every arm at every cap; ``memory`` (default ``memory_factor * cap``) is the host page cache.

    ``params``: the model of every VM (its ``block_size`` is replaced by
    ``block_size``); ``rest``: the policy of the memory nobody pins
    (``linux`` or ``lru``); ``prefetch_rate``: bytes per trace second each
    VM may load into new pins, as the agents' setting (None: unlimited);
    ``fill`` False: pins take only resident units (``fill: cached``);
    ``exact``: the models decide on the reads counted exactly (the agents'
    default, ``read_model: counted``), else on residency and read evidence
    (``read_model: inferred``).
    ``cache_unit``: what the page cache holds, a divisor of ``block_size``
    (default the block; 4 KiB is the host's page, so the kernel keeps the
    pages a guest touched while a pin holds whole blocks). Device reads and
    loads are counted in these units. The units pins loaded are device reads
    the guest does not wait for, reported apart (``loaded_units``,
    ``loaded_per_request``, and ``loaded_read_share``: the share the guest
    read within two minutes), not in the device reads per request. Raises
    ValueError for no VMs, duplicate names, an unknown arm, a cap above the
    memory, a cache unit that does not divide the block or a trace past its
    VM's size.
    """
    unknown = set(arms) - set(ARMS)
    if unknown:
        raise ValueError(f"unknown arms: {', '.join(sorted(unknown))} (known: {', '.join(ARMS)})")
    p, merged = prepare(vms, block_size, params, cache_unit)
    unit = merged.bt.block_size
    out: list[HostResult] = []
    for cap in caps:
        mem = memory if memory is not None else int(cap * memory_factor)
        if cap > mem:
            raise ValueError(f"cap {cap} is more than the memory {mem}")
        capacity = mem // unit
        for arm in arms:
            if arm in SHARED:
                total, per_vm = _results(arm, cap, mem, merged, vms, SHARED[arm](merged.bt, capacity))
                out.append(HostResult(arm, cap, mem, total, per_vm))
                continue
            hits, states, loads = run_split(arm, merged, vms, cap, capacity, p, rest, prefetch_rate, fill, exact)
            total, per_vm = _results(arm, cap, mem, merged, vms, hits, loads)
            cycles = max(1, len(cycle_ends(merged.bt, p.interval)))
            out.append(HostResult(arm, cap, mem, total, per_vm,
                                  {s.vm.name: s.grant_sum / cycles for s in states},
                                  {s.vm.name: s.pinned_sum / cycles for s in states}))
    return out


def run_split(arm: str, merged: Merged, vms: list[HostVm], cap: int, capacity: int,
               params: ModelParams, rest: str, prefetch_rate: int | None, fill: bool = True,
               exact: bool = False, restart: Restart | None = None) -> tuple[NDArray[np.bool_], list[_Vm], Loads]:
    """Hits per access of one split arm, the VMs' states at the end and what their pins loaded.

    Each VM's cycle runs under the grant of the previous split; its demand
    curve after the step feeds the next split (the agents' one-cycle lag).
    ``restart``: every VM starts from its saved set, a first cycle at the
    trace's start on no access (vmcache.replay.sim's ``warm`` arm).
    """
    bt = merged.bt
    per = params.block_size // bt.block_size
    warm_rate = restart.warm_rate if restart else None
    states = [_Vm(vm, i, off, units, size, Cycle(params, units // per, prefetch_rate=prefetch_rate, warm_rate=warm_rate,
                                                           residency_unit=bt.block_size, fill=fill),
                  np.zeros(0, dtype=np.int64))
              for i, (vm, off, units, size) in enumerate(zip(vms, merged.offsets, merged.units, merged.sizes))]
    if restart is not None:
        for s in states:
            s.cycle.warm = restart.warm.get(s.vm.name)
    benefit = arm == "benefit"
    grants = _benefit_grants(states, None, cap) if benefit else static_grants(arm, vms, cap)
    hits = bytearray(len(bt))
    loads = Loads()
    if len(bt) == 0:
        return np.zeros(0, dtype=bool), states, loads
    memory = Memory(rest_cache(rest, capacity, bt.block_size), capacity)
    block, write = bt.block.tolist(), bt.write.tolist()
    t0 = float(bt.time[0])
    begin = 0
    first = 0 if restart is None else -1  # a restart's first cycle: at the start, on no access
    for k, end in enumerate([0] * -first + cycle_ends(bt, params.interval), start=first):
        memory.serve(block, write, begin, end, hits)
        served = np.frombuffer(bytes(hits[begin:end]), dtype=bool)
        resident = np.sort(np.fromiter(memory.resident(), dtype=np.int64))
        wanted = []
        now = t0 + params.interval * (k + 1)
        for s in states:
            s.granted = grants[s.vm.name]
            if restart:
                restart.hook.before(s.vm.name, s.cycle, now)
            _step(s, merged, begin, end, served, resident, now, exact)
            if restart:
                restart.hook.after(s.vm.name, s.cycle, now)
            wanted.append(sampling.units_of(s.pinned, per, s.units) + s.offset)
            s.grant_sum += s.granted
            s.pinned_sum += int(s.pinned.size) * params.block_size
        loads.add(now, memory.pin(np.concatenate(wanted), fill))
        for s in states:
            s.cycle.pinned(s.current)
            if restart:
                restart.hook.pinned(s.vm.name, s.cycle, now)
        begin = end
        if benefit:
            grants = _benefit_grants(states, params, cap)
    return np.frombuffer(bytes(hits), dtype=bool).copy(), states, loads


def _step(s: _Vm, merged: Merged, begin: int, end: int, hit: NDArray[np.bool_], resident: NDArray[np.int64],
          now: float, exact: bool = False) -> None:
    """One VM's cycle at the end of an interval, on its accesses in [begin, end) and its residency.

    ``exact``: the cycle decides on the reads counted exactly, else on the read evidence of its pinned
    blocks.
    """
    mine = merged.vm[begin:end] == s.index
    bt = merged.bt
    unit = bt.block[begin:end][mine] - s.offset
    write = bt.write[begin:end][mine]
    own = resident[(resident >= s.offset) & (resident < s.offset + s.units)] - s.offset
    per = s.cycle.params.block_size // bt.block_size
    counted = sampling.guest_reads(unit, write, bt.pages[begin:end][mine], hit[mine], per, bt.block_size) \
        if exact else None
    seen = None if exact else sampling.seen(unit, write, s.pinned, per * bt.block_size, per)
    s.current = s.cycle.step(sampling.residency(own.tolist(), per),
                             sampling.written(unit, write, per, bt.block_size), s.current, size_bytes=s.size,
                             budget=s.granted, now=now, seen=seen, reads=counted).regions
    s.pinned = blocks_of(s.current, s.cycle.params.block_size, s.cycle.nblocks)


def _benefit_grants(states: list[_Vm], params: ModelParams | None, cap: int) -> dict[str, int]:
    """The benefit split of the VMs' demand curves (None ``params``: no curves yet, the start)."""
    demands = {}
    for s in states:
        curve = () if params is None else demand_of(s.cycle.model.active, params, size_bytes=s.size,
                                                    budget=s.vm.budget, current=s.current)
        demands[s.vm.name] = Demand(budget=s.vm.budget, minimum=s.vm.minimum, curve=curve, granted=s.granted)
    return split(demands, cap).grants
