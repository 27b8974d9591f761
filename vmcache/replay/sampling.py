"""What the host samples at the end of a replayed interval, as the engine's cycle takes it (pure).

All sparse (:class:`~vmcache.model.blocks.BlockValues`, model blocks with
something to say), so a cycle costs what the interval's accesses and the
cache's units cost, not the disk's size:

- :func:`written`: the share of each model block's dirty-bitmap granules
  the guest wrote (the dirty bitmap, exact);
- :func:`guest_reads`: the guest's reads counted exactly
  (:class:`~vmcache.model.reads.GuestReads`, what the kernel's read counter
  gives the engine): pages read per block, hits and misses, and the pages
  its read misses brought in;
- :func:`residency`: the resident share of each block, any cause (the
  inferred path's input, what mincore gives);
- :func:`seen`: for pinned blocks, the share of their pages read (the
  inferred path's read evidence, what referenced bits give).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from numpy.typing import NDArray

from ..model.blocks import BlockValues, member
from ..model.params import PAGE_SIZE
from ..model.reads import GuestReads

__all__ = ["DIRTY_GRANULE", "written", "guest_reads", "residency", "seen", "units_of"]

DIRTY_GRANULE = 64 * 1024
"""Granularity of the dirty bitmap the engine reads (vmcache.service.app's default)."""

Index = NDArray[np.int64]


def _summed(blocks: Index, weights: NDArray[np.floating] | None = None) -> tuple[Index, NDArray[np.float64]]:
    """Sorted distinct ``blocks`` and the count (or the sum of ``weights``) of each."""
    index, inverse = np.unique(blocks, return_inverse=True)
    return index.astype(np.int64), np.bincount(inverse, weights=weights, minlength=index.size).astype(np.float64)


def written(unit: Index, write: NDArray[np.bool_], per: int, unit_bytes: int) -> BlockValues:
    """The share of each model block (``per`` units) whose dirty granules the accesses wrote."""
    granule = max(1, min(DIRTY_GRANULE, per * unit_bytes) // unit_bytes)  # units per dirty granule
    dirty = np.unique(unit[write] // granule)
    index, count = _summed(dirty * granule // per)
    return BlockValues(index, np.minimum(1.0, count * (granule / per)).astype(np.float32))


def guest_reads(unit: Index, write: NDArray[np.bool_], pages: NDArray[np.int32], hit: NDArray[np.bool_],
                per: int, unit_bytes: int) -> GuestReads:
    """The accesses' reads counted per model block: pages read, and pages read misses brought in (a whole unit)."""
    reads = ~write
    index, count = _summed(unit[reads] // per, pages[reads].astype(np.float64))
    missed = reads & ~hit
    mindex, mcount = _summed(unit[missed] // per)
    return GuestReads(BlockValues(index, count.astype(np.float32)),
                      BlockValues(mindex, (mcount * max(1, unit_bytes // PAGE_SIZE)).astype(np.float32)))


def residency(units: Iterable[int], per: int) -> BlockValues:
    """The resident share of each model block, from the resident units."""
    resident = np.fromiter(units, dtype=np.int64)
    if per == 1:
        resident.sort()
        return BlockValues(resident, np.ones(resident.size, dtype=np.float32))
    index, count = _summed(resident // per)
    return BlockValues(index, (count / per).astype(np.float32))


def seen(unit: Index, write: NDArray[np.bool_], pinned: Index, block_bytes: int, per: int) -> BlockValues:
    """Read evidence of the ``pinned`` model blocks: the share of each one's pages read (4 KiB a read access).

    Every pinned block is listed, 0 where nothing was read.
    """
    read = unit[~write] // per
    index, count = _summed(read[member(read, pinned)])
    value = np.zeros(pinned.size, dtype=np.float32)
    value[np.searchsorted(pinned, index)] = np.minimum(1.0, count * (PAGE_SIZE / block_bytes))
    return BlockValues(pinned, value)


def units_of(blocks: Index, per: int, nunits: int) -> Index:
    """The units of model ``blocks`` (sorted), below ``nunits``."""
    if per == 1:
        return blocks[blocks < nunits]
    units = (blocks[:, None] * per + np.arange(per, dtype=np.int64)).ravel()
    return units[units < nunits]
