"""The guest's reads of one disk in one cycle, counted exactly (pure).

Where the host can count them in the kernel (host/readcount.py, a BPF
program on the page cache's read path) or a trace says them (the replay),
the cycle gets every read the guest made, cache hits included: the reuse
the kernel's own LRU acts on, which residency alone cannot show. Where it
cannot, the cycle is given None and infers reads from residency growth
and referenced bits as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .blocks import BlockValues, member, positions

__all__ = ["GuestReads", "idle"]


@dataclass(frozen=True)
class GuestReads:
    """Per model block, 4 KiB pages the guest read since the last cycle, and how many of them missed.

    ``pages``: every page a guest read asked for, hit or miss, each page of
    a request counted once; ``missed``: pages the guest's reads brought into
    the page cache (device reads, the kernel's readahead for them included),
    so ``missed`` may exceed ``pages`` in a block readahead ran ahead into.
    Both list only blocks with a non-zero count (BlockValues, sorted).
    """

    pages: BlockValues
    missed: BlockValues

    @classmethod
    def empty(cls) -> GuestReads:
        return cls(BlockValues.empty(), BlockValues.empty())

    def totals(self) -> tuple[int, int]:
        """Pages the guest read, and of those the pages found in the page cache (per block: read minus missed)."""
        pages, missed = self.pages, self.missed
        found = member(pages.index, missed.index)
        brought = np.zeros(pages.index.size, np.float32)
        brought[found] = missed.value[positions(missed.index, pages.index[found])]
        return int(pages.value.sum()), int(np.maximum(pages.value - brought, 0).sum())


def idle(counted: GuestReads | None, written: BlockValues) -> bool:
    """Whether the guest was idle this cycle: its reads were counted, and it read nothing and wrote nothing.

    The inferred path takes a resident block for a read one, since a hit
    leaves no other trace, and holds the heat of the blocks it pinned
    (ours) where it has no evidence of them; pinned blocks whose sampled
    references show none cool. While the guest is idle (paused, or
    between jobs) these three would part - the blocks it left in the
    cache as hot as when it read them, pins released earlier held,
    pinned ones cooling - and the plan would move from one to the other,
    each move a reload if the block was evicted meanwhile. Once the guest
    is idle (``Cycle``'s ``IDLE_CYCLES`` such cycles running: a region
    written once still gets the cycles it needs to be pinned whole), every
    block's heat fades at ``decay``: the plan keeps its order and only
    shrinks. Counted reads tell idle from all hits; without them the
    residency is taken as before.
    """
    return counted is not None and not counted.pages.index.size and not (written.value > 0).any()
