"""Replay a block trace through page caches of a given size: vmcache, LRU, Belady, static top-k.

Everything is simulated at one granularity, ``block_size`` bytes (also the
model's block size): a request touches every block its byte range overlaps,
and each touched block is one *access*. Reads and writes both count: with
``cache='writethrough'`` a written page lands in the page cache, so a write
to a cached block is a hit and a write to an uncached one is a miss that
brings the block in. Hit ratio = hits / accesses (read hits / read accesses
is reported beside it).

Every policy gets the same memory, ``capacity = budget // block_size``
blocks:

- ``lru``: plain LRU of ``capacity`` blocks, empty at the start.
- ``vmcache``: the same LRU, but the blocks vmcache pins are never evicted
  and count against the capacity (the LRU holds ``capacity - pinned``).
  Every ``interval`` seconds of trace time it runs the engine's own cycle
  (:class:`~vmcache.model.cycle.Cycle`, what
  :class:`~vmcache.service.engine.DiskEngine` runs between sampling and
  pinning) on what the host would have sampled: residency of the simulated
  cache, the blocks written during the interval (the dirty bitmap), read
  evidence of pinned blocks, the pinned regions, ``now`` = the trace time
  and ``pin_share * budget`` as the byte budget, without a prefetch limit.
  Every region it plans is pinned. Newly pinned blocks leave the LRU or, if not resident, are
  loaded (counted as ``prefetched``, not as misses: the agent loads them
  off the guest's I/O path); unpinned blocks go back to the LRU as most
  recently used (munlock puts pages back on the kernel's LRU) and stay
  "ours" until evicted.
- ``belady``: the optimal replacement (MIN) with next-use times known in
  advance, allowed to bypass (not cache) a block whose next use is later
  than every cached one's; an upper bound for any policy, ``>= lru``.
- ``static``: the ``capacity`` blocks most accessed over the whole trace
  (known in advance) are cached on their first access and never evicted;
  nothing else is cached. The best *fixed* set, not a bound on adaptive
  policies.

All start with an empty cache, so the first access to a block is a miss
for every policy but vmcache, which may load a pinned region before the
guest reads it: vmcache alone can beat ``belady`` (a bound for caches that
load on demand).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ..model.cycle import Cycle, blocks_mask
from ..model.params import PAGE_SIZE, ModelParams
from ..model.region import Region
from ..model.warm import WarmStart, heat_of
from .trace import Trace

__all__ = ["BlockTrace", "PolicyResult", "POLICIES", "WARM", "saved_hotset", "to_blocks", "next_use", "lru", "belady",
           "static_topk", "vmcache", "replay", "interval_inputs", "cycle_ends", "serve"]

POLICIES = ("vmcache", "lru", "belady", "static")
WARM = "warm"
"""vmcache warm-started from the hot set a previous replay of the trace saved (not in the defaults)."""


@dataclass(frozen=True)
class BlockTrace:
    """A trace cut into block accesses: parallel arrays, one entry per (request, block)."""

    block: NDArray[np.int64]
    time: NDArray[np.float64]
    write: NDArray[np.bool_]
    block_size: int
    nblocks: int

    def __len__(self) -> int:
        return len(self.block)


@dataclass(frozen=True)
class PolicyResult:
    """How one policy did at one memory size."""

    policy: str
    budget: int
    accesses: int
    hits: int
    read_accesses: int
    read_hits: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def read_hit_ratio(self) -> float:
        return self.read_hits / self.read_accesses if self.read_accesses else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"policy": self.policy, "budget_bytes": self.budget, "accesses": self.accesses, "hits": self.hits,
                "hit_ratio": round(self.hit_ratio, 6), "read_accesses": self.read_accesses,
                "read_hits": self.read_hits, "read_hit_ratio": round(self.read_hit_ratio, 6), **self.extra}


def to_blocks(trace: Trace, block_size: int, size_bytes: int | None = None) -> BlockTrace:
    """One access per block each request overlaps; ``nblocks`` covers ``size_bytes`` (default: the trace's end).

    Raises ValueError for a block size under 1 or a request past ``size_bytes``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    end = trace.end
    size = end if size_bytes is None else size_bytes
    if end > size:
        raise ValueError(f"the trace reaches byte {end}, past the image size {size}")
    first = trace.offset // block_size
    last = (trace.offset + trace.length - 1) // block_size
    counts = last - first + 1
    starts = np.cumsum(counts) - counts
    total = int(counts.sum())
    within = np.arange(total, dtype=np.int64) - np.repeat(starts, counts)
    block = np.repeat(first, counts) + within
    return BlockTrace(block.astype(np.int64), np.repeat(trace.time, counts), np.repeat(trace.write, counts),
                      block_size, -(-size // block_size))


def next_use(block: NDArray[np.int64]) -> NDArray[np.int64]:
    """Index of the next access to the same block, ``len(block)`` where there is none."""
    n = len(block)
    result = np.full(n, n, dtype=np.int64)
    if n < 2:
        return result
    order = np.lexsort((np.arange(n), block))  # by block, then by position: a backward pass per block
    same = block[order[1:]] == block[order[:-1]]
    result[order[:-1][same]] = order[1:][same]
    return result


def _result(name: str, budget: int, bt: BlockTrace, hit: NDArray[np.bool_], head: float | None = None,
            **extra: Any) -> PolicyResult:
    reads = ~bt.write
    if head is not None and len(bt):
        first = bt.time < bt.time[0] + head
        extra["head_hit_ratio"] = round(float(hit[first].mean()), 6) if first.any() else 0.0
    return PolicyResult(name, budget, len(bt), int(hit.sum()), int(reads.sum()), int((hit & reads).sum()),
                        dict(extra))


def saved_hotset(run: VmcacheRun, params: ModelParams, size_bytes: int) -> WarmStart:
    """The hot set a replay ended with, through the record the agent saves (top regions, heat to 1/256)."""
    from ..settings.hotset import DiskHotSet, HotSet, build_hotset, parse_hotset

    record = DiskHotSet("vda", "/replay", size_bytes, None, params.block_size, tuple(run.hot))
    (disk,) = parse_hotset(build_hotset(HotSet(saved=0, disks=(record,)))).disks
    return WarmStart(((r, disk.mean_heat(r)) for r in disk.regions), params)


def lru(bt: BlockTrace, capacity: int) -> NDArray[np.bool_]:
    """Hit (True) or miss per access for a plain LRU cache of ``capacity`` blocks, empty at the start."""
    hits = bytearray(len(bt))
    cache: OrderedDict[int, None] = OrderedDict()
    for i, b in enumerate(bt.block.tolist()):
        hits[i] = _lru_access(cache, b, capacity)
    return np.frombuffer(bytes(hits), dtype=bool).copy()


def _lru_access(cache: OrderedDict[int, None], block: int, capacity: int) -> bool:
    """One access to an LRU ``cache`` of at most ``capacity`` blocks; True on a hit."""
    if block in cache:
        cache.move_to_end(block)
        return True
    cache[block] = None
    if len(cache) > capacity:
        cache.popitem(last=False)
    return False


def belady(bt: BlockTrace, capacity: int) -> NDArray[np.bool_]:
    """Hit or miss per access for the optimal policy (MIN with bypass) of ``capacity`` blocks."""
    n = len(bt)
    hits = bytearray(n)
    if capacity <= 0:
        return np.zeros(n, dtype=bool)
    nxt = next_use(bt.block).tolist()
    cache: dict[int, int] = {}  # block -> index of its next use
    heap: list[tuple[int, int]] = []  # (-next use, block); stale entries skipped lazily
    for i, b in enumerate(bt.block.tolist()):
        nu = nxt[i]
        if b in cache:
            hits[i] = 1
        elif len(cache) >= capacity:
            while cache.get(heap[0][1]) != -heap[0][0]:
                heapq.heappop(heap)
            if -heap[0][0] <= nu:
                continue  # every cached block is used again before this one: do not cache it
            del cache[heapq.heappop(heap)[1]]
        cache[b] = nu
        heapq.heappush(heap, (-nu, b))
    return np.frombuffer(bytes(hits), dtype=bool).copy()


def static_topk(bt: BlockTrace, capacity: int) -> NDArray[np.bool_]:
    """Hit or miss per access when only the ``capacity`` most accessed blocks are cached (on first use)."""
    if capacity <= 0 or len(bt) == 0:
        return np.zeros(len(bt), dtype=bool)
    counts = np.bincount(bt.block, minlength=bt.nblocks)
    top = np.argsort(-counts, kind="stable")[:capacity]
    chosen = np.zeros(bt.nblocks, dtype=bool)
    chosen[top] = True
    first = np.zeros(len(bt), dtype=bool)
    first[np.unique(bt.block, return_index=True)[1]] = True
    return chosen[bt.block] & ~first


def cycle_ends(bt: BlockTrace, interval: float) -> list[int]:
    """Index one past the last access of each ``interval`` of trace time, from the first access on."""
    if len(bt) == 0:
        return []
    t0 = float(bt.time[0])
    ncycles = int((float(bt.time[-1]) - t0) // interval) + 1
    bounds: list[int] = np.searchsorted(bt.time, t0 + interval * np.arange(1, ncycles + 1), side="left").tolist()
    return bounds


def serve(blocks: list[int], begin: int, end: int, hits: bytearray, pinned: set[int],
          cache: OrderedDict[int, None], room: int) -> None:
    """Accesses ``begin..end`` of ``blocks``: a hit when pinned, else through the LRU ``cache`` of ``room`` blocks."""
    for i in range(begin, end):
        b = blocks[i]
        hits[i] = b in pinned or _lru_access(cache, b, room)


def interval_inputs(block: NDArray[np.int64], write: NDArray[np.bool_], pinned: NDArray[np.bool_],
                    block_size: int, *, unit: int | None = None) -> tuple[NDArray[np.float32], NDArray[np.float32]]:
    """What the engine samples at the end of an interval with these accesses: the written map, read evidence.

    ``block`` holds cache units of ``unit`` bytes (default: ``block_size``,
    one unit per model block); ``pinned`` is per model block. Written: the
    share of each model block's dirty-bitmap granules (64 KiB, or the block
    when smaller) written, 1.0 when the unit is the block. Read evidence of
    pinned blocks, as the engine gets it from the pages' referenced bits:
    the share of the block's pages read (4 KiB reads); NaN elsewhere.
    """
    nb = len(pinned)
    per = 1 if unit is None else block_size // unit
    granule = max(1, min(DIRTY_GRANULE, block_size) // (unit or block_size))  # units per dirty granule
    dirty = np.unique(block[write] // granule)
    written = np.minimum(1.0, np.bincount(dirty * granule // per, minlength=nb) * (granule / per)).astype(np.float32)
    read = block[~write] // per
    read = read[pinned[read]]
    seen = np.full(nb, np.nan, dtype=np.float32)
    seen[pinned] = np.minimum(1.0, np.bincount(read, minlength=nb)[pinned] * (PAGE_SIZE / block_size))
    return written, seen


DIRTY_GRANULE = 64 * 1024
"""Granularity of the dirty bitmap the engine reads (vmcache.service.app's default)."""


def _sampled(bt: BlockTrace, begin: int, end: int, pinned: NDArray[np.bool_], block_size: int
             ) -> tuple[NDArray[np.float32], NDArray[np.float32]]:
    """What the engine samples after accesses ``begin:end`` of ``bt`` (see :func:`interval_inputs`)."""
    return interval_inputs(bt.block[begin:end], bt.write[begin:end], pinned, block_size, unit=bt.block_size)


def _residency(units: NDArray[np.int64], per: int, nblocks: int) -> NDArray[np.float32]:
    """Resident share of each model block of ``per`` cache units, from the resident units."""
    if per == 1:
        resident = np.zeros(nblocks, dtype=np.float32)
        resident[units] = 1.0
        return resident
    return (np.bincount(units // per, minlength=nblocks) / per).astype(np.float32)


def _repin(cache: OrderedDict[int, None], pinned: NDArray[np.bool_], wanted: NDArray[np.bool_]) -> int:
    """Move blocks between the LRU and the pinned set; return how many pinned blocks had to be loaded.

    Released blocks go back to the LRU as most recently used (munlock puts
    pages back on the kernel's LRU); newly pinned ones leave it, or are
    loaded when not resident (off the guest's I/O path: not misses).
    """
    for b in np.flatnonzero(pinned & ~wanted).tolist():
        cache[b] = None
    loaded = 0
    for b in np.flatnonzero(wanted & ~pinned).tolist():
        if b in cache:
            del cache[b]
        else:
            loaded += 1
    return loaded


@dataclass
class VmcacheRun:
    """What the vmcache arm did, beside its hits."""

    hits: NDArray[np.bool_]
    cycles: int = 0
    prefetched: int = 0
    pinned_blocks_mean: float = 0.0
    pinned_blocks_max: int = 0
    hot: list[Region] = field(default_factory=list)
    """The regions held at the end, priority = their heat (what a saved hot set keeps)."""


def _check_fits(bt: BlockTrace, capacity: int, params: ModelParams, pin_budget: int) -> None:
    """Raises ValueError when the model's block size is not a multiple of the trace's or the pin budget exceeds
    the cache."""
    bs = bt.block_size
    if params.block_size % bs:
        raise ValueError(f"model block_size {params.block_size} is not a multiple of the trace's {bs}")
    if pin_budget > capacity * bs:
        raise ValueError(f"pin budget {pin_budget} is more than the cache ({capacity} blocks of {bs})")


class _Units:
    """The simulated host cache in cache units: the pinned units and an LRU of the others, ``capacity`` in all."""

    def __init__(self, nunits: int, per: int, capacity: int) -> None:
        self.per = per  # cache units per model block
        self.capacity = capacity
        self.pinned = np.zeros(nunits, dtype=bool)
        self.pinset: set[int] = set()
        self.lru: OrderedDict[int, None] = OrderedDict()  # the unpinned resident units
        self.room = capacity

    def resident(self) -> NDArray[np.int64]:
        """Every resident unit: pinned ones, then the LRU's."""
        units = np.flatnonzero(self.pinned)
        if self.lru:
            units = np.concatenate([units, np.fromiter(self.lru.keys(), dtype=np.int64, count=len(self.lru))])
        return units

    def pin(self, blocks: NDArray[np.bool_]) -> int:
        """Pin the units of the model ``blocks`` (mask); how many units had to be loaded."""
        wanted = np.repeat(blocks, self.per)[:len(self.pinned)]
        loaded = _repin(self.lru, self.pinned, wanted)
        self.pinned = wanted
        self.pinset = set(np.flatnonzero(wanted).tolist())
        self.room = self.capacity - len(self.pinset)
        while len(self.lru) > self.room:
            self.lru.popitem(last=False)
        return loaded


def vmcache(bt: BlockTrace, capacity: int, *, params: ModelParams, pin_budget: int,
            size_bytes: int | None = None, warm: WarmStart | None = None, prefetch_rate: int | None = None,
            warm_rate: int | None = None,
            on_cycle: Callable[[float, NDArray[np.bool_]], None] | None = None) -> VmcacheRun:
    """Hit or miss per access for vmcache's pinning over an LRU, ``capacity`` blocks in all.

    ``params``: the model parameters (its ``block_size`` must be a multiple
    of the trace's, whose blocks are then the cache's units: the model sees
    the resident share of each of its blocks; its ``interval`` is the
    re-planning period in trace seconds);
    ``pin_budget``: bytes ``plan`` may pin, at most ``capacity`` blocks;
    ``warm``: a saved hot set to start from - as the agent does, a first
    cycle at the start of the trace seeds the heat and pins (its loads
    count as prefetched, not as misses); ``prefetch_rate``, ``warm_rate``:
    bytes per trace second the cycle's token bucket lets new regions load,
    as the agent's (vmcache.model.cycle), None for no limit; ``on_cycle``:
    called after each cycle with its trace time and the model blocks it
    pinned. Raises ValueError when they do not fit.
    """
    bs, mbs = bt.block_size, params.block_size
    _check_fits(bt, capacity, params, pin_budget)
    n, nb = len(bt), bt.nblocks
    per = mbs // bs  # cache units per model block
    nmb = -(-nb // per)
    size = nb * bs if size_bytes is None else size_bytes
    run = VmcacheRun(hits=np.zeros(n, dtype=bool))
    if n == 0:
        return run
    hits = bytearray(n)
    cycle = Cycle(params, nmb, prefetch_rate=prefetch_rate, warm_rate=warm_rate)
    cycle.warm = warm
    pinned = np.zeros(nmb, dtype=bool)  # model blocks
    host = _Units(nb, per, capacity)
    current: list[Region] = []
    blocks = bt.block.tolist()
    t0 = float(bt.time[0])
    bounds = cycle_ends(bt, params.interval)
    pinned_total = begin = 0
    for k in range(-1 if warm is not None else 0, len(bounds)):
        end = bounds[k] if k >= 0 else 0
        serve(blocks, begin, end, hits, host.pinset, host.lru, host.room)
        # one engine cycle at the end of the interval, on what the host would have sampled
        written, seen = _sampled(bt, begin, end, pinned, mbs)
        begin = end
        current = cycle.step(_residency(host.resident(), per, nmb), written, current, size_bytes=size,
                             budget=pin_budget, now=t0 + params.interval * (k + 1), seen=seen).regions
        pinned = blocks_mask(current, mbs, nmb)
        run.prefetched += host.pin(pinned)
        cycle.pinned(current)
        if on_cycle is not None:
            on_cycle(t0 + params.interval * (k + 1), pinned)
        pinned_total += len(host.pinset)
        run.pinned_blocks_max = max(run.pinned_blocks_max, len(host.pinset))
    run.hits = np.frombuffer(bytes(hits), dtype=bool).copy()
    run.hot = heat_of(current, cycle.model.active, mbs)
    run.cycles = len(bounds)
    run.pinned_blocks_mean = pinned_total / (len(bounds) + (warm is not None))  # the warm start's first cycle too
    return run


_BASELINES: dict[str, Callable[[BlockTrace, int], NDArray[np.bool_]]] = {
    "lru": lru, "belady": belady, "static": static_topk,
}


def _vmcache_results(names: list[str], bt: BlockTrace, budget: int, capacity: int, pin_budget: int,
                     p: ModelParams, *, size_bytes: int | None, size: int, head: float | None,
                     prefetch_rate: int | None, warm_rate: int | None) -> dict[str, PolicyResult]:
    """The vmcache arms at one budget: cold (``vmcache``) and warm-started from the cold run's hot set (``warm``)."""
    if not names:
        return {}
    cold = vmcache(bt, capacity, params=p, pin_budget=pin_budget, size_bytes=size_bytes, prefetch_rate=prefetch_rate)
    out = {}
    for name in names:
        run = cold
        extra: dict[str, Any] = {}
        if name == WARM:
            warm = saved_hotset(cold, p, size)
            run = vmcache(bt, capacity, params=p, pin_budget=pin_budget, size_bytes=size_bytes, warm=warm,
                          prefetch_rate=prefetch_rate, warm_rate=warm_rate)
            extra = {"warm_saved_blocks": warm.total_bytes // p.block_size,
                     "warm_restored_blocks": warm.restored_bytes // p.block_size}
        out[name] = _result(name, budget, bt, run.hits, head, cycles=run.cycles, prefetched_blocks=run.prefetched,
                            pinned_blocks_mean=round(run.pinned_blocks_mean, 1),
                            pinned_blocks_max=run.pinned_blocks_max, **extra)
    return out


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
) -> list[PolicyResult]:
    """Every policy at every budget (bytes of memory); results in budget order, then policy order.

    ``params``: model parameters (default ``ModelParams()``); ``block_size``
    and ``interval`` (when given) replace theirs. ``pin_share``: the share
    of each budget vmcache's planner may pin (0..1]. Policy ``warm`` is
    vmcache restarted with the hot set a first replay of the same trace
    saved at its end (a VM's second boot). ``head``: also report the hit
    ratio over the first ``head`` seconds (``head_hit_ratio``).
    ``prefetch_rate``, ``warm_rate``: the vmcache arms' prefetch limit
    (bytes per trace second; None: none, the loads are free).
    ``cache_unit``: bytes the simulated caches hold and count accesses in
    (default ``block_size``); a smaller unit (a 4 KiB page) makes the model
    see how much of each block is resident, as on a host. Raises ValueError
    for an unknown policy, a bad share, a block size that is not a multiple
    of the unit or parameters ModelParams refuses.
    """
    unknown = set(policies) - {*POLICIES, WARM}
    if unknown:
        known = ", ".join((*POLICIES, WARM))
        raise ValueError(f"unknown policies: {', '.join(sorted(unknown))} (known: {known})")
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
        ours = _vmcache_results([n for n in policies if n not in _BASELINES], bt, budget, capacity, pin_budget, p,
                                size_bytes=size_bytes, size=size, head=head, prefetch_rate=prefetch_rate,
                                warm_rate=warm_rate)
        for name in policies:
            baseline = _BASELINES.get(name)
            results.append(_result(name, budget, bt, baseline(bt, capacity), head) if baseline else ours[name])
    return results
