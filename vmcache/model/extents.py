"""The guest's writes of one cycle: extents in image-file bytes, and per block (pure numpy).

The dirty-bitmap tracker (vmcache.host.tracker) returns a :class:`DirtyRead`;
the engine turns its extents into per-block fractions for the model. Extents
are ``int64`` arrays of shape ``(n, 2)``: ``(offset, length)`` rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from .blocks import BlockValues

__all__ = ["BitmapRead", "DirtyRead", "MAX_BITMAP_BITS", "empty_extents", "merge_extents", "cover_extents",
           "extents_to_blocks", "extents_to_block_values", "granularity_for"]


class BitmapRead(str, Enum):
    """How one cycle's dirty-bitmap read went (the ``result`` label of vmcache_bitmap_reads_total)."""

    OK = "ok"
    DEFERRED = "deferred"  # could not read this cycle; the writes are kept for a later one
    FAILED = "failed"      # the read failed; the bitmaps are kept for a later one
    NONE = "none"          # no tracker for this disk (counted nowhere)


def empty_extents() -> np.ndarray:
    """An extents array with no rows."""
    return np.zeros((0, 2), dtype=np.int64)


def merge_extents(extents: np.ndarray) -> np.ndarray:
    """Sort ``(offset, length)`` rows and merge those that touch or overlap; drop empty rows."""
    ext = np.asarray(extents, dtype=np.int64).reshape(-1, 2)
    ext = ext[ext[:, 1] > 0]
    if len(ext) < 2:
        return ext.copy()
    ext = ext[np.argsort(ext[:, 0], kind="stable")]
    starts = ext[:, 0]
    ends = starts + ext[:, 1]
    reach = np.maximum.accumulate(ends)
    new = np.empty(len(ext), dtype=bool)
    new[0] = True
    new[1:] = starts[1:] > reach[:-1]
    group = np.cumsum(new) - 1
    out_starts = starts[new]
    out_ends = np.zeros(len(out_starts), dtype=np.int64)
    np.maximum.at(out_ends, group, ends)
    return np.column_stack((out_starts, out_ends - out_starts))


def cover_extents(extents: np.ndarray, granularity: int, end: int, *, max_gap: int, max_ranges: int) -> np.ndarray:
    """Few ``(offset, length)`` rows within ``[0, end)`` that cover every granule ``extents`` touch.

    Each row is widened to whole ``granularity`` blocks (clipped to ``end``),
    rows closer than ``max_gap`` bytes are joined, and while more than
    ``max_ranges`` rows remain the smallest gaps are closed. Covers at least
    what it is given (in granules); never more than the granules of the
    first and last row span. Raises ValueError for a granularity under 1
    or ``max_ranges`` under 1.
    """
    if granularity <= 0 or max_ranges <= 0:
        raise ValueError("granularity and max_ranges must be > 0")
    ext = np.asarray(extents, dtype=np.int64).reshape(-1, 2)
    ext = ext[ext[:, 1] > 0]
    starts = np.maximum(ext[:, 0] // granularity * granularity, 0)
    ends = np.minimum(-(-(ext[:, 0] + ext[:, 1]) // granularity) * granularity, end)
    keep = starts < ends
    rows = merge_extents(np.column_stack((starts[keep], ends[keep] - starts[keep])))
    if len(rows) < 2:
        return rows
    starts, ends = rows[:, 0], rows[:, 0] + rows[:, 1]
    gaps = starts[1:] - ends[:-1]
    close = gaps <= max_gap
    over = int((~close).sum()) + 1 - max_ranges
    if over > 0:  # close the smallest of the gaps still open
        open_at = np.flatnonzero(~close)
        close[open_at[np.argsort(gaps[open_at], kind="stable")[:over]]] = True
    first = np.concatenate(([True], ~close))
    last = np.concatenate((~close, [True]))
    return np.column_stack((starts[first], ends[last] - starts[first]))


@dataclass(frozen=True)
class DirtyRead:
    """One cycle's writes: ``extents`` ``(offset, length)`` rows in image-file bytes.

    Not ``OK``: nothing was read this cycle (``reason`` says why), ``extents``
    is empty, the writes are kept and come with a later read.
    """

    status: BitmapRead = BitmapRead.OK
    extents: np.ndarray = field(default_factory=empty_extents)
    reason: str = ""

    @property
    def deferred(self) -> bool:
        return self.status is BitmapRead.DEFERRED

    @property
    def error(self) -> str | None:
        """Why a failed read failed (None for any other result: a deferral is no error)."""
        return self.reason if self.status is BitmapRead.FAILED else None

    @property
    def bytes(self) -> int:
        return int(self.extents[:, 1].sum()) if len(self.extents) else 0


def extents_to_blocks(extents: np.ndarray, block_size: int, nblocks: int) -> np.ndarray:
    """Fraction of each block written: float32 array of ``nblocks`` entries in [0, 1].

    The dense form of :func:`extents_to_block_values` (same rules). Raises
    ValueError for a block size under 1 or a negative ``nblocks``.
    """
    return extents_to_block_values(extents, block_size, nblocks).to_dense(nblocks)


def extents_to_block_values(extents: np.ndarray, block_size: int, nblocks: int) -> BlockValues:
    """The blocks written and the fraction of each written, in [0, 1] (sorted; cost follows the extents).

    ``extents`` are ``(offset, length)`` rows in bytes (any order, may
    overlap); bytes past ``nblocks * block_size`` are ignored. A partial
    last block counts against a full ``block_size``. Raises ValueError for
    a block size under 1 or a negative ``nblocks``.
    """
    if block_size <= 0 or nblocks < 0:
        raise ValueError("block_size must be > 0 and nblocks >= 0")
    ext = merge_extents(extents)
    if nblocks == 0 or len(ext) == 0:
        return BlockValues.empty()
    starts = ext[:, 0]
    ends = np.minimum(starts + ext[:, 1], nblocks * block_size)
    keep = starts < ends
    starts, ends = starts[keep], ends[keep]
    first = starts // block_size
    counts = (ends - 1) // block_size - first + 1
    total = int(counts.sum())
    within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    blocks = np.repeat(first, counts) + within
    low = np.maximum(blocks * block_size, np.repeat(starts, counts))
    high = np.minimum((blocks + 1) * block_size, np.repeat(ends, counts))
    index, inverse = np.unique(blocks, return_inverse=True)
    written = np.bincount(inverse, weights=(high - low).astype(np.float64), minlength=index.size)
    return BlockValues(index.astype(np.int64), np.minimum(written / block_size, 1.0).astype(np.float32))


#: Bits a tracker's bitmap may have (16 MiB of it in QEMU): QEMU merges a bitmap in a pass over all of it.
MAX_BITMAP_BITS = 1 << 27


def granularity_for(size: int, granularity: int, max_bits: int = MAX_BITMAP_BITS) -> int:
    """The bitmap granularity for a node of ``size`` bytes: ``granularity``, doubled until ``max_bits`` cover it.

    A read merges the bitmaps in one pass over their whole length (docs/tracker.md), so a huge thin disk
    gets coarser granules rather than a merge that grows with its size: 64 KiB up to 8 TiB, 512 KiB at 64 TiB.
    """
    while size > granularity * max_bits:
        granularity *= 2
    return granularity
