"""A trace cut into cache-unit accesses, with what each costs at the device on a miss (pure).

Every cache of the replay works at one granularity, the *unit*
(``--cache-unit``, by default the model's block): a request touches each
unit its byte range overlaps, and each touched unit is one *access*. Per
access the replay keeps what the measures and the exact read counts need:

- ``costly``: whether a miss costs a device read. Under
  ``cache='writethrough'`` a write goes to the device whatever is cached,
  and a write to an uncached page needs no read - unless it covers the page
  only in part, when the kernel reads the page first. So a read access is
  costly, and a write access is costly where the unit holds a page the
  write covers only in part (its first or last page, when the request is
  not page-aligned there);
- ``pages``: the 4 KiB pages of the request inside the unit (each page of a
  request once), what :class:`~vmcache.model.reads.GuestReads` counts.

Units are the disk's own indices (``offset // unit``): the caches key on
them, so a 720 GiB disk costs what its touched units cost.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from ..model.params import PAGE_SIZE
from .trace import Trace

__all__ = ["BlockTrace", "to_blocks", "next_use", "cycle_ends"]


@dataclass(frozen=True)
class BlockTrace:
    """A trace cut into unit accesses: parallel arrays, one entry per (request, unit)."""

    block: NDArray[np.int64]
    time: NDArray[np.float64]
    write: NDArray[np.bool_]
    block_size: int
    nblocks: int
    pages: NDArray[np.int32]
    """Pages of the request inside the unit."""
    costly: NDArray[np.bool_]
    """Whether a miss is a device read."""
    request: NDArray[np.int64]
    """The guest request each access comes from (an index, one per request)."""

    @classmethod
    def aligned(cls, block: NDArray[np.int64], time: NDArray[np.float64], write: NDArray[np.bool_],
                block_size: int, nblocks: int) -> BlockTrace:
        """Accesses of page-aligned requests of one unit each: every page read or written, reads costly."""
        full = max(1, block_size // PAGE_SIZE)
        return cls(block, time, write, block_size, nblocks, np.full(len(block), full, dtype=np.int32),
                   ~np.asarray(write, dtype=bool), np.arange(len(block), dtype=np.int64))

    def __len__(self) -> int:
        return len(self.block)

    def requests(self, select: NDArray[np.bool_] | None = None) -> int:
        """How many guest requests the accesses (those ``select`` keeps) come from."""
        return int(np.unique(self.request if select is None else self.request[select]).size)


def to_blocks(trace: Trace, block_size: int, size_bytes: int | None = None) -> BlockTrace:
    """One access per unit of ``block_size`` bytes each request overlaps; ``nblocks`` covers ``size_bytes``.

    ``size_bytes`` defaults to the trace's end. Raises ValueError for a unit
    under 1 or a request past ``size_bytes``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    end = trace.end
    size = end if size_bytes is None else size_bytes
    if end > size:
        raise ValueError(f"the trace reaches byte {end}, past the image size {size}")
    last_byte = trace.offset + trace.length - 1
    first = trace.offset // block_size
    last = last_byte // block_size
    counts = last - first + 1
    starts = np.cumsum(counts) - counts
    total = int(counts.sum())
    within = np.arange(total, dtype=np.int64) - np.repeat(starts, counts)
    block = np.repeat(first, counts) + within
    write = np.repeat(trace.write, counts)
    # pages of the request inside each unit
    unit_first_page = block * block_size // PAGE_SIZE
    unit_last_page = ((block + 1) * block_size - 1) // PAGE_SIZE
    req_first_page = np.repeat(trace.offset // PAGE_SIZE, counts)
    req_last_page = np.repeat(last_byte // PAGE_SIZE, counts)
    pages = (np.minimum(unit_last_page, req_last_page) - np.maximum(unit_first_page, req_first_page) + 1)
    # a write covering a page in part reads it first: the units of its partial first and last pages
    head = np.repeat(trace.write & (trace.offset % PAGE_SIZE != 0), counts) & (within == 0)
    tail = np.repeat(trace.write & ((last_byte + 1) % PAGE_SIZE != 0), counts) & (within == np.repeat(counts - 1,
                                                                                                     counts))
    costly = ~write | head | tail
    return BlockTrace(block.astype(np.int64), np.repeat(trace.time, counts), write, block_size,
                      -(-size // block_size), pages.astype(np.int32), costly,
                      np.repeat(np.arange(len(trace), dtype=np.int64), counts))


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


def cycle_ends(bt: BlockTrace, interval: float) -> list[int]:
    """Index one past the last access of each ``interval`` of trace time, from the first access on."""
    if len(bt) == 0:
        return []
    t0 = float(bt.time[0])
    ncycles = int((float(bt.time[-1]) - t0) // interval) + 1
    bounds: list[int] = np.searchsorted(bt.time, t0 + interval * np.arange(1, ncycles + 1), side="left").tolist()
    return bounds
