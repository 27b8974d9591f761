"""What a disk's pins are worth: the reads they served that the kernel alone would likely have missed (pure).

A read of a pinned page is always a hit. Whether the kernel alone would have
had it depends on how long it keeps a page it is not asked to keep, and the
counted reads of the unpinned blocks say that: a block read again after a
gap of ``g`` seconds was found cached (hits) or not (misses). Gaps are
binned by powers of two (a first read since the start is a bin of its own),
each bin's hits and reads decayed with a half-life, so the estimate follows
the host's pressure as it changes. A pinned block's hits read after gap
``g`` are worth ``hits x miss share of g's bin`` among the unpinned blocks:
what the kernel would have read from the device for them. A bin with no
unpinned evidence counts nothing: the estimate never claims a saving it has
not seen the kernel fail to make.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from .blocks import BlockValues, member, positions, union

__all__ = ["PinValue", "PinCost", "PinWorth", "GAP_BINS", "VALUE_HALF_LIFE"]

#: Gap bins: [0, 2), [2, 4), ... [2**(GAP_BINS-2), inf) seconds, and the last one for first reads.
GAP_BINS = 18
#: Seconds over which a bin's evidence halves: the kernel's retention moves with the host's pressure.
VALUE_HALF_LIFE = 600.0
#: Pages of unpinned evidence a bin needs before its miss share is believed.
MIN_EVIDENCE = 16.0
#: Blocks whose last read is remembered at most (the most recent kept: 16 MiB, however large the disk).
KEEP_BLOCKS = 1 << 20

FIRST = GAP_BINS - 1


@dataclass(frozen=True)
class PinWorth:
    """One cycle's judgement of a disk's pins, in bytes: what they saved the guest, what they cost the others
    (None: not known, no limit's figures), and the kernel's retention the saving was judged by."""

    saved_bytes: int
    cost_bytes: int | None
    retention: float | None

    def __post_init__(self) -> None:
        if self.saved_bytes < 0 or (self.cost_bytes or 0) < 0:
            raise ValueError(f"negative worth {self.saved_bytes}, {self.cost_bytes}")


class PinValue:
    """Per disk: the last read of each block, the kernel's misses by gap, and the pages the pins saved."""

    def __init__(self, nblocks: int = 0, *, half_life: float = VALUE_HALF_LIFE, keep: int = KEEP_BLOCKS) -> None:
        if nblocks < 0 or not half_life > 0 or keep < 1:
            raise ValueError(f"nblocks must be >= 0, half_life > 0 and keep >= 1, got {nblocks}, {half_life}, {keep}")
        self._half_life, self._keep, self._nblocks = half_life, keep, nblocks
        self._read: NDArray[np.int64] = np.zeros(0, np.int64)   # blocks read (sorted), sparse: a disk may be huge
        self._when: NDArray[np.float64] = np.zeros(0)          # and when each was read last
        self._reads: NDArray[np.float64] = np.zeros(GAP_BINS)
        self._misses: NDArray[np.float64] = np.zeros(GAP_BINS)
        self._then: float | None = None
        self.saved_pages = 0.0  # since the start
        self.reread_missed = 0.0  # in the last cycle: pages missed on blocks read before (the disk's own refaults)

    def resize(self, nblocks: int) -> None:
        """Follow the disk to ``nblocks`` blocks (the last reads of the blocks past a shrunk end forgotten)."""
        keep = self._read < nblocks
        self._read, self._when, self._nblocks = self._read[keep], self._when[keep], nblocks

    def miss_share(self) -> NDArray[np.float64]:
        """Per gap bin, the share of the unpinned blocks' read pages that missed (NaN: too little evidence)."""
        share = np.full(GAP_BINS, np.nan)
        known = self._reads >= MIN_EVIDENCE
        share[known] = np.minimum(self._misses[known] / self._reads[known], 1.0)
        return share

    def retention(self) -> float | None:
        """Seconds the kernel keeps an unpinned page read again, as seen: the lower edge of the first gap bin
        where most re-reads missed (inf: none did; None: too little evidence)."""
        share = self.miss_share()[:FIRST]
        known = ~np.isnan(share)
        if not known.any():
            return None
        missed = np.flatnonzero(known & (share > 0.5))
        return math.inf if missed.size == 0 else float(_lower_edge(int(missed[0])))

    def add(self, pages: BlockValues, missed: BlockValues, pinned: NDArray[np.int64], now: float) -> float:
        """One cycle's counted reads (pages and missed pages per block, sorted) with ``pinned`` (sorted
        blocks) pinned during it; return the pages the pins saved in it. Raises ValueError for a ``now``
        not finite."""
        if not math.isfinite(now):
            raise ValueError(f"now must be finite, got {now!r}")
        if self._then is not None and now > self._then:
            fade = 0.5 ** ((now - self._then) / self._half_life)
            self._reads *= fade
            self._misses *= fade
        self._then = now if self._then is None else max(now, self._then)
        some = (pages.value > 0) & (pages.index < self._nblocks)
        blocks, read = pages.index[some], pages.value[some].astype(np.float64)
        lost = np.minimum(missed.at(blocks).astype(np.float64), read)
        known = member(blocks, self._read)
        at = positions(self._read, blocks[known])
        last = np.full(blocks.size, np.nan)  # not read since the start, or forgotten: a first read
        last[known] = self._when[at]
        bins = _bins(now - last)
        held = member(blocks, pinned)
        np.add.at(self._reads, bins[~held], read[~held])
        np.add.at(self._misses, bins[~held], lost[~held])
        share = np.nan_to_num(self.miss_share(), nan=0.0)
        saved = float(((read - lost)[held] * share[bins[held]]).sum())
        self.reread_missed = float(lost[bins != FIRST].sum())
        self._when[at] = now  # a block read again: in place
        self._remember(blocks[~known], now)
        self.saved_pages += saved
        return saved

    def _remember(self, new: NDArray[np.int64], now: float) -> None:
        """Add the blocks read for the first time (sorted) at ``now``, the most recent kept."""
        if new.size == 0:
            return
        merged = union(self._read, new)
        when = np.full(merged.size, now)
        when[positions(merged, self._read)] = self._when
        if merged.size > 2 * self._keep:  # the most recent kept
            kept = np.sort(np.argsort(-when, kind="stable")[:self._keep])
            merged, when = merged[kept], when[kept]
        self._read, self._when = merged, when


def _lower_edge(b: int) -> int:
    return 0 if b == 0 else 2 ** b


def _bins(gaps: NDArray[np.float64]) -> NDArray[np.int64]:
    """The gap bin of each gap in seconds (NaN, never read: the first-read bin)."""
    out = np.full(gaps.size, FIRST, np.int64)
    seen = ~np.isnan(gaps)
    out[seen] = np.minimum(np.floor(np.log2(np.maximum(gaps[seen], 1.0))).astype(np.int64), FIRST - 1)
    return out


class PinCost:
    """What a disk's pins cost the others under the page cache they press on: the file pages refaulted there
    (read back soon after the kernel evicted them), times the pins' share of that page cache.

    An estimate, as the saving is: the pins took that share of the memory the refaulted pages needed.
    """

    def __init__(self) -> None:
        self._seen: int | None = None
        self.cost_pages = 0.0  # since the start

    def add(self, refaulted: int, file_bytes: int, pinned_bytes: int, own: float = 0.0) -> float:
        """One cycle: the refault counter now, the page cache and the disk's pinned bytes; return its cost.

        ``own``: the disk's own pages read back in the cycle (its misses on blocks read before): they are
        not the others', and what the pins do to the disk itself is the plan's to weigh (PinShare).
        """
        if min(refaulted, file_bytes, pinned_bytes, own) < 0:
            raise ValueError(f"negative figures {refaulted}, {file_bytes}, {pinned_bytes}, {own}")
        # a counter that went back is another cgroup's (QEMU moved): counted from its value now
        delta = 0.0 if self._seen is None or refaulted < self._seen else max(0.0, refaulted - self._seen - own)
        self._seen = refaulted
        share = min(1.0, pinned_bytes / file_bytes) if file_bytes else 0.0
        self.cost_pages += delta * share
        return delta * share
