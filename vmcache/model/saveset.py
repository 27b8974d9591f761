"""What a disk saves for its next start: the blocks the guest reads most, up to the budget (pure).

A saved hot set (vmcache.settings.hotset) is restored after a restart, a
host reboot or a live migration (vmcache.model.warm). It is a bet on what
the guest reads in its first minutes there, not on what is hot enough to
pin now: where the kernel's cache already keeps the hot blocks, the pin
share (vmcache.model.exact ``PinShare``) leaves them to it and pins little,
and a set of the pins would restore almost nothing.

So per disk the cycle keeps a :class:`ReadTally` - the pages the guest read
in each block, from the reads counted exactly, halved every
:data:`TALLY_HALF_LIFE` - and :func:`saved_regions` ranks the blocks by it
(then by their own heat: blocks written and read back, and everything where
reads are not counted), takes the top ones up to the budget, with no
threshold, and merges them into at most ``max_regions`` regions. On the
real traces the tally since the start predicted the next start's reads
better than the heat at the save (docs/replay.md, "What a hot set saves").
The tally also keeps the cycle since the start in which the guest first
read each block (:meth:`ReadTally.first_cycles`): saved with each region,
it is the order a warm start restores them in (vmcache.model.warm).

What a live migration carries (:func:`carried_regions`) is a bet on the next
minutes of a guest that goes on running, on a destination whose cache is
empty: every block carried is read whole from the storage there, and pays
only if the guest reads it again. So where reads are counted it carries only
blocks with proven reuse - most of the guest's reads of them found the page
already cached (hits, :data:`REUSE_SHARE`) - the blocks it reads now first
(:meth:`ReadTally.reused`, halved every :data:`RECENT_HALF_LIFE`), then the
most read, so that a workload that moved a minute before arrives with its
new hot set however long it read the old one; then what a warm start
restored that the guest has not read yet (still a start's bet, not judged
yet: a guest migrated right after its start). A guest that reads each page
once (a web server serving new files, a scan) carries nothing, and its
destination reads what the kernel alone would (docs/replay.md, "What a
migration carries").
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from .blocks import BlockValues, PrefixSums, member, positions, runs, union
from .heat import ActiveHeat
from .params import PAGE_SIZE, ModelParams
from .region import Region

__all__ = ["RECENT_HALF_LIFE", "RECENT_PAGES", "REUSE_SHARE", "TALLY_BLOCKS", "TALLY_HALF_LIFE", "ReadTally",
           "carried_regions", "saved_regions"]

TALLY_HALF_LIFE = 6 * 3600.0
"""Seconds in which a block's read count halves: long enough that the reads after a start still
count hours later (an hour of a real trace ranked no better with any half-life above an hour, and
worse at a quarter of one), short enough that a guest whose work moved is followed within a day."""

RECENT_HALF_LIFE = 30.0
"""Seconds in which a block's recent read count halves: a zone the guest has read for a minute outweighs
one it read for hours until then (3/4 of the steady count against 1/4)."""

RECENT_PAGES = 1.0
"""A block read less than this (decayed) in the recent count is not read now: its rank is its tally's."""

REUSE_SHARE = 0.5
"""A block a migration carries: more than this share of the guest's (decayed) reads of it found the page
cached. A page read once is a miss and proves nothing; a block whose pages the guest goes back to is a hit
most of the time once cached."""

TALLY_BLOCKS = 65536
"""Blocks a tally keeps: once it holds twice as many, the least read go (64 GiB of 1 MiB blocks)."""

Index = NDArray[np.int64]


class ReadTally:
    """Per block, the guest's read pages summed over the cycles, each halved every ``half_life`` seconds,
    and when the guest first read it since the tally's first cycle (the agent's start: a domain's start)."""

    def __init__(self, *, half_life: float = TALLY_HALF_LIFE, keep: int = TALLY_BLOCKS) -> None:
        if not half_life > 0 or keep < 1:
            raise ValueError(f"half_life must be > 0 and keep >= 1, got {half_life}, {keep}")
        self._half_life = half_life
        self._keep = keep
        self._blocks: Index = np.zeros(0, np.int64)
        self._counts: NDArray[np.float64] = np.zeros(0, np.float64)
        self._first: NDArray[np.float64] = np.zeros(0, np.float64)  # seconds from the start to the first read
        self._recent: NDArray[np.float64] = np.zeros(0, np.float64)  # the same count, halved every RECENT_HALF_LIFE
        self._hits: NDArray[np.float64] = np.zeros(0, np.float64)  # of the counts, the pages found cached
        self._recent_hits: NDArray[np.float64] = np.zeros(0, np.float64)  # of the recent ones
        self._start: float | None = None
        self._last: float | None = None

    @property
    def counts(self) -> BlockValues:
        """The blocks read, and each one's decayed count of pages (sorted)."""
        return BlockValues(self._blocks, self._counts.astype(np.float32))

    @property
    def counted(self) -> bool:
        """Whether the guest's reads were ever given (counted exactly): without them the tally is empty."""
        return self._start is not None

    def reused(self, *, recent: bool) -> BlockValues:
        """The blocks with proven reuse (more than :data:`REUSE_SHARE` of their reads hits), each one's
        count (``recent``: the recent count, those read at least :data:`RECENT_PAGES` in it)."""
        counts, hits = (self._recent, self._recent_hits) if recent else (self._counts, self._hits)
        keep = hits > REUSE_SHARE * counts  # never where nothing was read: hits are at most the counts
        if recent:
            keep &= counts >= RECENT_PAGES
        return BlockValues(self._blocks[keep], counts[keep].astype(np.float32))

    def add(self, pages: BlockValues, now: float, missed: BlockValues | None = None) -> None:
        """One cycle's reads (pages per block, sorted) at ``now``, and of them the pages that ``missed`` the
        cache (:class:`~vmcache.model.reads.GuestReads`; None: none did). Raises ValueError for a ``now``
        not finite."""
        if not math.isfinite(now):
            raise ValueError(f"now must be finite, got {now!r}")
        if self._last is not None and now > self._last:
            slow, fast = 0.5 ** ((now - self._last) / self._half_life), 0.5 ** ((now - self._last) / RECENT_HALF_LIFE)
            self._counts *= slow
            self._hits *= slow
            self._recent *= fast
            self._recent_hits *= fast
        self._last = now if self._last is None else max(now, self._last)
        if self._start is None:
            self._start = now
        some = pages.value > 0
        read, added = pages.index[some], pages.value[some].astype(np.float64)
        if read.size == 0:
            return
        hits = added if missed is None else np.maximum(added - missed.at(read), 0.0)
        blocks = union(self._blocks, read)
        old, at = positions(blocks, self._blocks), positions(blocks, read)
        arrays = []
        for kept, new in ((self._counts, added), (self._recent, added), (self._hits, hits), (self._recent_hits, hits)):
            grown = np.zeros(blocks.size, np.float64)
            grown[old] = kept
            grown[at] += new
            arrays.append(grown)
        first = np.full(blocks.size, max(0.0, self._last - self._start))
        first[old] = self._first
        arrays.append(first)
        if blocks.size > 2 * self._keep:
            kept = np.sort(np.argsort(-arrays[0], kind="stable")[:self._keep])
            blocks, arrays = blocks[kept], [a[kept] for a in arrays]
        self._blocks = blocks
        self._counts, self._recent, self._hits, self._recent_hits, self._first = arrays

    def first_cycles(self, regions: Sequence[Region], params: ModelParams) -> tuple[int, ...]:
        """Per region, the cycle since the start in which the guest first read one of its blocks, counted
        from 1 (``interval`` seconds each); 0 for a region none of whose blocks the tally holds."""
        bs = params.block_size
        firsts = []
        for region in regions:
            lo, hi = np.searchsorted(self._blocks, [region.start // bs, -(-region.end // bs)])
            firsts.append(1 + int(self._first[lo:hi].min() // params.interval) if hi > lo else 0)
        return tuple(firsts)

    def resize(self, nblocks: int) -> None:
        """Forget the blocks past a disk shrunk to ``nblocks``."""
        keep = self._blocks < nblocks
        self._blocks, self._counts, self._first = self._blocks[keep], self._counts[keep], self._first[keep]
        self._recent, self._hits, self._recent_hits = self._recent[keep], self._hits[keep], self._recent_hits[keep]


def saved_regions(counts: BlockValues, active: ActiveHeat, params: ModelParams, *, budget: int,
                  size_bytes: int) -> list[Region]:
    """The regions a disk saves for its next start: its most read blocks within ``budget`` bytes, highest
    priority first.

    Blocks are ranked by ``counts`` (a :class:`ReadTally`'s), then by own
    heat (``active``), ties by offset; every block with either is a
    candidate. The longest head of that ranking is taken whose regions
    fit, merged as a warm start's planner will pin them: runs at most
    ``merge_gap`` blocks apart are one region (the gap counts against the
    budget), and beyond ``max_regions`` regions the smallest gaps are
    closed. A region's priority is its heat summed over its blocks, each
    block counted at least at ``threshold``: a block read long ago has lost
    its heat but is what the next start is likely to read, and a warm start
    gives up a region held under ``threshold / keep_factor``. Raises
    ValueError for a negative budget or size.
    """
    return _fitted((counts,), active, params, budget=budget, size_bytes=size_bytes, own_heat=True)


def carried_regions(tally: ReadTally, active: ActiveHeat, params: ModelParams, *, budget: int,
                    size_bytes: int, unjudged: Index | None = None) -> list[Region]:
    """The regions a live migration carries, as :func:`saved_regions` fits and orders them: where reads
    are counted (:attr:`ReadTally.counted`), only the blocks with proven reuse (:meth:`ReadTally.reused`),
    those read now first, ranked by their recent count, then the rest by their tally, then the ``unjudged``
    blocks (sorted: a warm start's the guest has not had its chance to read yet, still a start's bet) by
    their own heat; where they are not, the blocks with heat of their own (the read signal inferred from
    residency cannot tell a hit)."""
    if not tally.counted:
        return saved_regions(tally.counts, active, params, budget=budget, size_bytes=size_bytes)
    levels = [tally.reused(recent=True), tally.reused(recent=False)]
    if unjudged is not None and unjudged.size:
        levels.append(BlockValues(unjudged, BlockValues(active.blocks, active.own).at(unjudged)))
    return _fitted(levels, active, params, budget=budget, size_bytes=size_bytes, own_heat=False)


def _fitted(levels: Sequence[BlockValues], active: ActiveHeat, params: ModelParams, *, budget: int,
            size_bytes: int, own_heat: bool) -> list[Region]:
    """The blocks of ``levels`` in turn, each ranked by its values (then own heat), then with ``own_heat`` the
    blocks with heat of their own, the longest head that fits ``budget`` merged into regions."""
    if budget < 0 or size_bytes < 0:
        raise ValueError(f"budget and size_bytes must not be negative, got {budget}, {size_bytes}")
    bs = params.block_size
    nblocks = -(-size_bytes // bs)
    most = budget // bs
    if most == 0:
        return []
    ranked = np.zeros(0, np.int64)
    for level in levels:
        take = (level.index < nblocks) & ~member(level.index, np.sort(ranked))
        ranked = np.concatenate((ranked, _top(level.index[take], level.value[take], active, most - ranked.size)))
    if own_heat and ranked.size < most:  # then the blocks with heat of their own the guest's counted reads do not cover
        rest = (active.own > 0) & (active.blocks < nblocks) & ~member(active.blocks, np.sort(ranked))
        ranked = np.concatenate((ranked, _top(active.blocks[rest], active.own[rest], None, most - ranked.size)))
    file_end = -(-size_bytes // PAGE_SIZE) * PAGE_SIZE
    lo, hi = 0, ranked.size  # the most blocks whose regions fit: more blocks never take fewer bytes
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _bytes(_cover(ranked[:mid], params), bs, file_end) <= budget:
            lo = mid
        else:
            hi = mid - 1
    starts, ends = _cover(ranked[:lo], params)
    t = np.float32(params.threshold)
    above = PrefixSums(active.blocks, np.maximum(active.heat - t, np.float32(0.0)))
    priority = (ends - starts) * float(t) + above.at(ends) - above.at(starts)  # sum of max(heat, threshold)
    regions = [Region(s * bs, min(e * bs, file_end) - s * bs, prio)
               for s, e, prio in zip(starts.tolist(), ends.tolist(), priority.tolist())]
    regions.sort(key=lambda r: (-r.priority, r.start))
    return regions


def _top(blocks: Index, value: NDArray[np.float32], active: ActiveHeat | None, most: int) -> Index:
    """The ``most`` of ``blocks`` (sorted) with the highest ``value``, then own heat (``active``), then the lowest
    offset, in that order: the rank is taken among those as high as the ``most``-th only."""
    if most <= 0:
        return np.zeros(0, np.int64)
    if blocks.size > most:
        some = value >= np.partition(value, blocks.size - most)[blocks.size - most]
        blocks, value = blocks[some], value[some]
    own = np.zeros(blocks.size, np.float32) if active is None else BlockValues(active.blocks, active.own).at(blocks)
    ranked: Index = blocks[np.lexsort((blocks, -own, -value))][:most]
    return ranked


def _cover(chosen: Index, params: ModelParams) -> tuple[Index, Index]:
    """The runs of ``chosen`` blocks merged across gaps of at most ``merge_gap``, then the smallest gaps
    closed until at most ``max_regions`` are left."""
    starts, ends = runs(np.sort(chosen))
    if starts.size < 2:
        return starts, ends
    gaps = starts[1:] - ends[:-1]
    apart = gaps > params.merge_gap
    excess = int(apart.sum()) + 1 - params.max_regions
    if excess > 0:
        wide = np.flatnonzero(apart)
        apart[wide[np.argsort(gaps[wide], kind="stable")[:excess]]] = False
    cut = np.flatnonzero(apart)
    return np.concatenate((starts[:1], starts[cut + 1])), np.concatenate((ends[cut], ends[-1:]))


def _bytes(cover: tuple[Index, Index], block_size: int, file_end: int) -> int:
    starts, ends = cover
    if starts.size == 0:
        return 0
    return int((ends - starts).sum()) * block_size - max(0, int(ends[-1]) * block_size - file_end)
