"""Replay a block trace through page caches of one size: vmcache's arms beside the baselines.

Every policy gets the same memory, ``capacity = budget // unit`` units, and
starts empty; the baselines (LRU, the kernel's lists, the read-aware
optimum, static top-k) are :mod:`vmcache.replay.baselines`, the measures
(device reads per request first) :mod:`vmcache.replay.measures`.

The vmcache arms are a host's page cache with vmcache on it: the units
vmcache pins are never evicted and count against the capacity; the rest of
the memory is the kernel's (``rest``: the Linux-like lists by default, or
plain LRU). Every ``interval`` seconds of trace time they run the engine's
own cycle (:class:`~vmcache.model.cycle.Cycle`, what
:class:`~vmcache.service.engine.DiskEngine` runs between sampling and
pinning) on what the host would have sampled (:mod:`vmcache.replay.sampling`),
``now`` = the trace time, ``pin_share * budget`` as the byte budget, and
pin every region it plans:

- ``vmcache``: the agent's default ``read_model``: the guest's reads counted
  exactly (``reads=GuestReads``, as the kernel's read counter gives them to
  the engine), and the dirty bitmap;
- ``inferred``: ``read_model: inferred``, the agent's signal where the
  kernel cannot count reads: residency, the dirty bitmap and read
  evidence of pinned blocks;
- ``warm``: ``vmcache`` restarted with the hot set a first run of the same
  trace saved at its end (a VM's second boot);
- ``snapshot``, ``most-read``: ``vmcache`` restarted on a cache another
  restore read back (:mod:`vmcache.replay.restore`), to measure ``warm`` by.

Newly pinned units leave the rest or, when not resident, are loaded
(``prefetched``, not misses: the agent loads them off the guest's I/O
path); unpinned units go back to the rest (:meth:`Rest.release`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import chain
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ..model.blocks import blocks_of
from ..model.cycle import Cycle
from ..model.params import ModelParams
from ..model.region import Region
from ..model.saveset import carried_regions, saved_regions
from ..model.warm import WarmStart
from . import restore, sampling
from .accesses import BlockTrace, cycle_ends, to_blocks
from .baselines import BASELINES, Rest, rest_cache
from .loads import WASTE_HORIZON, Loads
from .measures import PolicyResult, loads_extra, measure
from .trace import Trace

__all__ = ["POLICIES", "ARMS", "WARM", "WARM_HEAT", "RESTS", "Memory", "VmcacheRun", "cycle_hotset", "saved_hotset",
           "vmcache", "replay"]

POLICIES = ("vmcache", "inferred", "lru", "linux", "belady")
"""The default policies: both vmcache arms, the host's baselines and the bound."""
WARM = "warm"
WARM_HEAT = "warm-heat"
"""``warm`` with the saved set restored in heat order, as a set saved without its first-read order."""
"""vmcache warm-started from the hot set a previous replay of the trace saved (not in the defaults)."""
ARMS = ("vmcache", "inferred", WARM, WARM_HEAT, *restore.RESTORES)
RESTS = ("linux", "lru")


class Memory:
    """A page cache with vmcache on it: the pinned units, and the ``rest`` policy over the others."""

    def __init__(self, rest: Rest, capacity: int) -> None:
        self.rest = rest
        self.capacity = capacity
        self.pinned: set[int] = set()

    def serve(self, block: list[int], write: list[bool], begin: int, end: int, hits: bytearray) -> None:
        """Accesses ``begin..end``: a hit when pinned, else through the rest."""
        pinned, access = self.pinned, self.rest.access
        for i in range(begin, end):
            b = block[i]
            hits[i] = b in pinned or access(b, write[i])

    def pin(self, units: NDArray[np.int64], fill: bool = True) -> list[int]:
        """Pin exactly ``units``; the units that had to be loaded (not resident before).

        ``fill`` False (the host config's ``fill: cached``): of the units not
        pinned yet, only the resident ones are pinned and nothing is loaded;
        the others are left to the rest until a later call finds them resident.
        """
        wanted = set(units.tolist())
        if fill:
            loaded = [u for u in wanted - self.pinned if not self.rest.discard(u)]
        else:
            loaded = []
            wanted = (wanted & self.pinned) | {u for u in wanted - self.pinned if self.rest.discard(u)}
        released = sorted(self.pinned - wanted)
        self.pinned = wanted
        self.rest.resize(self.capacity - len(wanted))
        for u in released:
            self.rest.release(u)
        self.rest.resize(self.capacity - len(wanted))  # what came back past the room: the oldest go
        return loaded

    def resident(self) -> Iterator[int]:
        return chain(self.pinned, self.rest)


@dataclass
class VmcacheRun:
    """What a vmcache arm did, beside its hits."""

    hits: NDArray[np.bool_]
    cycles: int = 0
    loads: Loads = field(default_factory=Loads)
    pinned_blocks_mean: float = 0.0
    pinned_blocks_max: int = 0
    hot: list[Region] = field(default_factory=list)
    """What the disk saves at the end (vmcache.model.saveset), priority = their heat."""
    first: tuple[int, ...] = ()
    """Per region of ``hot``, the cycle in which the guest first read it (from 1; 0: not read)."""
    carried: list[Region] = field(default_factory=list)
    """What a live migration at the end would carry (vmcache.model.saveset ``carried_regions``)."""
    resident: NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    """The units cached at the end, pinned or not."""
    saved_pages: float = 0.0
    """The agent's estimate of the pages its pins saved (vmcache.model.pinvalue; counted reads only)."""


def cycle_hotset(cycle: Cycle, *, budget: int, size_bytes: int) -> tuple[list[Region], tuple[int, ...]]:
    """What the disk of ``cycle`` saves now (vmcache.model.saveset, up to ``budget``): the regions, priority =
    their heat, and per region the cycle in which the guest first read it."""
    hot = saved_regions(cycle.tally.counts, cycle.model.active, cycle.params, budget=budget, size_bytes=size_bytes)
    return hot, cycle.tally.first_cycles(hot, cycle.params)


def saved_hotset(hot: list[Region], first: tuple[int, ...], params: ModelParams, size_bytes: int, *,
                 ordered: bool = True) -> WarmStart:
    """The hot set a replay ended with (:func:`cycle_hotset`), through the record the agent saves (top
    regions, heat to 1/256, first-read cycles); ``ordered`` False: restored in heat order, as a set saved
    without an order."""
    from ..settings.hotset import DiskHotSet, HotSet, build_hotset, parse_hotset

    record = DiskHotSet("vda", "/replay", size_bytes, None, params.block_size, tuple(hot), first)
    (disk,) = parse_hotset(build_hotset(HotSet(saved=0, disks=(record,)))).disks
    return WarmStart(((r, disk.mean_heat(r)) for r in disk.regions), params, disk.order() if ordered else None)


def _check_fits(bt: BlockTrace, capacity: int, params: ModelParams, pin_budget: int) -> None:
    """ValueError when the model's block is not a multiple of the trace's unit or the pin budget exceeds the cache."""
    bs = bt.block_size
    if params.block_size % bs:
        raise ValueError(f"model block_size {params.block_size} is not a multiple of the trace's {bs}")
    if pin_budget > capacity * bs:
        raise ValueError(f"pin budget {pin_budget} is more than the cache ({capacity} blocks of {bs})")


def step_inputs(bt: BlockTrace, begin: int, end: int, hit: NDArray[np.bool_], pinned: NDArray[np.int64],
                memory: Memory, per: int, *, exact: bool) -> dict[str, Any]:
    """The cycle's inputs after accesses ``begin:end`` of ``bt`` (``hit``: theirs): ``Cycle.step`` keywords.

    What the host samples: residency and the dirty bitmap, and the reads
    counted exactly (``exact``) or the read evidence of the model blocks
    ``pinned`` during the interval (sorted).
    """
    unit, write = bt.block[begin:end], bt.write[begin:end]
    inputs: dict[str, Any] = {"residency": sampling.residency(memory.resident(), per),
                              "written": sampling.written(unit, write, per, bt.block_size)}
    reads = sampling.guest_reads(unit, write, bt.pages[begin:end], hit, per, bt.block_size)
    if exact:
        inputs["reads"] = reads
    else:
        inputs["seen"] = sampling.seen(unit, write, pinned, per * bt.block_size, per)
    return inputs


def vmcache(bt: BlockTrace, capacity: int, *, params: ModelParams, pin_budget: int,
            size_bytes: int | None = None, warm: WarmStart | None = None, prefetch_rate: int | None = None,
            warm_rate: int | None = None, rest: str = "linux", exact: bool = True, fill: bool = True,
            preload: NDArray[np.int64] | None = None,
            on_cycle: Callable[[float, NDArray[np.int64]], None] | None = None) -> VmcacheRun:
    """Hit or miss per access for vmcache's pins over the ``rest`` policy, ``capacity`` units in all.

    ``params``: the model parameters (its ``block_size`` a multiple of the trace's unit: the model sees
    the resident share of each of its blocks; its ``interval`` the re-planning period in trace seconds);
    ``pin_budget``: bytes the cycle may pin, at most ``capacity`` units; ``warm``: a saved hot set to start
    from - as the agent does, a first cycle at the start of the trace seeds the heat and pins (its loads
    count as prefetched); ``prefetch_rate``, ``warm_rate``: the cycle's token bucket (bytes per trace
    second, None: no limit); ``rest``: ``linux`` or ``lru``; ``exact``: give the cycle the reads counted
    exactly (else it infers them); ``fill`` False: pins take only resident units and load nothing but a
    saved hot set (:meth:`Memory.pin`); ``preload``: units read into the cache before the first access
    (their loads count at the trace's start; :func:`~vmcache.replay.restore.preload`); ``on_cycle``: called
    after each cycle with its trace time and the model blocks it pinned (sorted). Raises ValueError when
    they do not fit.
    """
    bs, mbs = bt.block_size, params.block_size
    _check_fits(bt, capacity, params, pin_budget)
    n, per = len(bt), mbs // bs
    nmb = -(-bt.nblocks // per)
    size = bt.nblocks * bs if size_bytes is None else size_bytes
    run = VmcacheRun(hits=np.zeros(n, dtype=bool))
    if n == 0:
        return run
    hits = bytearray(n)
    cycle = Cycle(params, nmb, prefetch_rate=prefetch_rate, warm_rate=warm_rate, residency_unit=bs, fill=fill)
    cycle.warm = warm
    memory = Memory(rest_cache(rest, capacity, bs), capacity)
    pinned = np.zeros(0, dtype=np.int64)  # model blocks
    current: list[Region] = []
    block, write = bt.block.tolist(), bt.write.tolist()
    t0 = float(bt.time[0])
    bounds = cycle_ends(bt, params.interval)
    if preload is not None:
        run.loads.add(t0, restore.preload(memory.rest, preload))
    pinned_total = begin = 0
    for k in range(-1 if warm is not None else 0, len(bounds)):
        end = bounds[k] if k >= 0 else 0
        memory.serve(block, write, begin, end, hits)
        served = np.frombuffer(bytes(hits[begin:end]), dtype=bool)
        inputs = step_inputs(bt, begin, end, served, pinned, memory, per, exact=exact)
        begin = end
        now = t0 + params.interval * (k + 1)
        current = cycle.step(pinned=current, size_bytes=size, budget=pin_budget, now=now, **inputs).regions
        pinned = blocks_of(current, mbs, nmb)
        run.loads.add(now, memory.pin(sampling.units_of(pinned, per, bt.nblocks), cycle.loads))
        cycle.pinned(current)
        if on_cycle is not None:
            on_cycle(now, pinned)
        pinned_total += len(memory.pinned)
        run.pinned_blocks_max = max(run.pinned_blocks_max, len(memory.pinned))
    run.cycles = len(bounds)
    run.pinned_blocks_mean = pinned_total / (len(bounds) + (warm is not None))  # the warm start's first cycle too
    return _ended(run, hits, cycle, memory, budget=pin_budget, size=size)


def _ended(run: VmcacheRun, hits: bytearray, cycle: Cycle, memory: Memory, *, budget: int, size: int) -> VmcacheRun:
    """``run`` with what the end of the trace leaves: the hits, the set the disk saves, the cache's units."""
    run.hits = np.frombuffer(bytes(hits), dtype=bool).copy()
    run.hot, run.first = cycle_hotset(cycle, budget=budget, size_bytes=size)
    run.carried = carried_regions(cycle.tally, cycle.model.active, cycle.params, budget=budget, size_bytes=size,
                                  unjudged=None if cycle.warm is None else cycle.warm.unjudged())
    run.resident = np.fromiter(memory.resident(), dtype=np.int64)
    run.saved_pages = cycle.pin_value.saved_pages
    return run


def _arm_results(names: list[str], bt: BlockTrace, budget: int, capacity: int, pin_budget: int,
                 p: ModelParams, *, size_bytes: int | None, size: int, head: float | None, **options: Any
                 ) -> dict[str, PolicyResult]:
    """The vmcache arms at one budget; ``warm`` and the restores start from the run of ``vmcache``."""
    runs: dict[str, VmcacheRun] = {}

    def first() -> VmcacheRun:
        if "vmcache" not in runs:
            runs["vmcache"] = vmcache(bt, capacity, params=p, pin_budget=pin_budget, size_bytes=size_bytes,
                                      **_cold(options))
        return runs["vmcache"]

    out = {}
    for name in names:
        extra: dict[str, Any] = {}
        if name in (WARM, WARM_HEAT):
            warm = saved_hotset(first().hot, first().first, p, size, ordered=name == WARM)
            run = vmcache(bt, capacity, params=p, pin_budget=pin_budget, size_bytes=size_bytes, warm=warm, **options)
            extra = {"warm_saved_blocks": warm.total_bytes // p.block_size,
                     "warm_restored_blocks": warm.restored_bytes // p.block_size}
        elif name in restore.RESTORES:
            units = restore.restored_units(name, bt, capacity, first().resident)
            run = vmcache(bt, capacity, params=p, pin_budget=pin_budget, size_bytes=size_bytes, preload=units,
                          **_cold(options))
            extra = {"restored_units": int(units.size)}
        elif name == "vmcache":
            run = first()
        else:
            run = vmcache(bt, capacity, params=p, pin_budget=pin_budget, size_bytes=size_bytes, exact=False,
                          **_cold(options))
        out[name] = measure(name, budget, bt, run.hits, head=head, cycles=run.cycles, prefetched_blocks=len(run.loads),
                            pinned_blocks_mean=round(run.pinned_blocks_mean, 1),
                            pinned_blocks_max=run.pinned_blocks_max,
                            **loads_extra(run.loads.used(bt), bt.requests()),
                            loaded_unread_bytes=int((~run.loads.used(bt, WASTE_HORIZON)).sum()) * bt.block_size,
                            pin_saved_pages=round(run.saved_pages), **extra)
    return out


def _cold(options: dict[str, Any]) -> dict[str, Any]:
    """The options of a cold run (no warm rate)."""
    return {k: v for k, v in options.items() if k != "warm_rate"}


def replay(
    trace: Trace,
    budgets: list[int],
    *,
    block_size: int,
    params: ModelParams | None = None,
    interval: float | None = None,
    pin_share: float = 1.0,
    size_bytes: int | None = None,
    policies: tuple[str, ...] = POLICIES,
    head: float | None = None,
    prefetch_rate: int | None = None,
    warm_rate: int | None = None,
    cache_unit: int | None = None,
    rest: str = "linux",
    fill: bool = True,
) -> list[PolicyResult]:
    """Every policy at every budget (bytes of memory); results in budget order, then policy order.

    ``params``: model parameters (default ``ModelParams()``); ``block_size``
    and ``interval`` (when given) replace theirs. ``pin_share``: the share
    of each budget vmcache's planner may pin (0..1]. ``head``: also the
    figures over the first ``head`` seconds. ``prefetch_rate``,
    ``warm_rate``: the vmcache arms' prefetch limit (bytes per trace
    second; None: none, the loads are free). ``cache_unit``: bytes the
    simulated caches hold and count accesses in (default ``block_size``);
    a smaller unit (a 4 KiB page) makes the model see how much of each block
    is resident, as on a host. ``rest``: the policy of the memory vmcache
    does not pin (``linux``, ``lru``). ``fill`` False: the vmcache arms'
    pins take only what is resident (``fill: cached``). Raises ValueError for an unknown
    policy or rest, a bad share, a block size that is not a multiple of the
    unit or parameters ModelParams refuses.
    """
    unknown = set(policies) - {*ARMS, *BASELINES}
    if unknown:
        known = ", ".join((*ARMS, *BASELINES))
        raise ValueError(f"unknown policies: {', '.join(sorted(unknown))} (known: {known})")
    if rest not in RESTS:
        raise ValueError(f"unknown rest policy {rest!r} (known: {', '.join(RESTS)})")
    if not 0.0 < pin_share <= 1.0:
        raise ValueError(f"pin_share must be in (0, 1], got {pin_share}")
    p = params or ModelParams()
    p = replace(p, block_size=block_size, interval=p.interval if interval is None else interval)
    unit = block_size if cache_unit is None else cache_unit
    if unit < 1 or block_size % unit:
        raise ValueError(f"block_size {block_size} is not a multiple of the cache unit {unit}")
    bt = to_blocks(trace, unit, size_bytes)
    results: list[PolicyResult] = []
    size = bt.nblocks * unit if size_bytes is None else size_bytes
    for budget in budgets:
        capacity = budget // unit
        pin_budget = int(capacity * pin_share) * unit
        ours = _arm_results([n for n in policies if n in ARMS], bt, budget, capacity, pin_budget, p,
                            size_bytes=size_bytes, size=size, head=head, prefetch_rate=prefetch_rate,
                            warm_rate=warm_rate, rest=rest, fill=fill)
        for name in policies:
            baseline = BASELINES.get(name)
            results.append(measure(name, budget, bt, baseline(bt, capacity), head=head) if baseline else ours[name])
    return results
