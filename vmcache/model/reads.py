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

__all__ = ["GuestReads"]


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
