"""Which blocks a new pin may fill: those cached whole, and those the guest is spreading through (pure).

Pinning a block mlocks all of it, so the pages of the block that are not
cached are read from the device. That pays where the guest goes on to read
them - a hot zone it covers a few pages a cycle at a time - and is pure
cost where it does not. On the real web server trace (1 MiB blocks over
4 KiB pages, the agent's view) pins filled three kinds of block the guest
then left alone, none of whose loaded pages it read within two minutes:

- blocks it reads the same part of, cycle after cycle;
- blocks never seen cached at all: the gaps the planner merges across
  (``merge_gap``) and the margins around hot runs;
- blocks the guest once read whole and the kernel has since evicted in
  part.

The blocks it was spreading through were the only loads it read (27-42% of
their pages; docs/benchmarks.md, issue 23).

So :class:`LoadGate` keeps, for each block the guest has read part of, its
peak cached fraction from the guest's reads (not from pins: what a pin
loaded says nothing about the guest) and when it rose. A block whose peak
rose in RISES cycles, the last within GROWTH_CYCLES, is one the guest is
spreading through. New pins may take a block only if it is spreading,
cached whole now (nothing to read) or pinned now (already locked);
:meth:`LoadGate.cut` leaves every other block out of new regions. Its cached
pages stay the kernel's to keep, and it is filled once the guest spreads
through it again.

That needs the residency to resolve pages within a block. Where it counts
whole blocks (the replay's default, cache units as large as the model's
blocks) a block is cached or not, nothing shows the guest's reach inside
it, and nothing is gated.

Memory: one entry per block cached now or with heat; a block neither is
forgotten.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from .blocks import BlockValues, member, positions, runs, union
from .region import Region

__all__ = ["LoadGate"]


GROWTH_CYCLES = 3
"""Cycles a block counts as spreading after its last new peak. A guest that
reads a hot zone slowly - 20 reads a second over 205 MiB is a page per block
per cycle - leaves a third of its blocks without a new page in any one
cycle, but hardly any for three (e^-3: 5%)."""

RISES = 3
"""New peaks that make a block spreading. The first is any first read of it
and the second one return. At two, on the web server trace replayed live at
12x its pace (two 10 s cycles are four minutes of it), the agent read about
as much from the device as the guest did, too little of it read within the
run to pay; at three, about half as much live, and a fifth to a third fewer
loads in the replay at the trace's own pace for at most 0.2% more misses
(docs/benchmarks.md, issue 23)."""


class LoadGate:
    """Per block the guest has read part of, its peak cached fraction; the blocks new pins may fill.

    ``pages``: whether the residency resolves pages within a block (the
    agent's always does); False gates nothing.
    """

    def __init__(self, *, pages: bool = True) -> None:
        self.pages = pages
        self._blocks = np.zeros(0, dtype=np.int64)  # sorted: the blocks tracked
        self._peak = np.zeros(0, dtype=np.float32)  # the guest's highest cached fraction of each
        self._rose = np.zeros(0, dtype=np.int64)    # the update that set it
        self._rises = np.zeros(0, dtype=np.int64)   # how many updates set a new one
        self._updates = 0
        self._fillable = np.zeros(0, dtype=np.int64)

    @property
    def fillable(self) -> NDArray[np.int64]:
        """The blocks cached whole or spread through by the guest at the last update (sorted)."""
        return self._fillable

    def update(self, resident: BlockValues, ours: NDArray[np.int64], heated: NDArray[np.int64]) -> None:
        """Take one cycle's residency; ``ours``: the blocks whose residency a pin caused; ``heated``: the
        blocks the model has heat for (both sorted: a block neither cached nor heated is forgotten).
        Nothing to keep where the residency does not resolve pages: :meth:`cut` gates nothing there.
        """
        if not self.pages:
            return
        self._updates += 1
        blocks = union(resident.index, self._blocks)
        value = resident.at(blocks)
        known = member(blocks, self._blocks)
        at = positions(self._blocks, blocks[known])
        peak = np.zeros(blocks.size, dtype=np.float32)
        rose = np.zeros(blocks.size, dtype=np.int64)
        rises = np.zeros(blocks.size, dtype=np.int64)
        peak[known], rose[known], rises[known] = self._peak[at], self._rose[at], self._rises[at]
        grew = ~member(blocks, ours) & (value > peak)
        peak[grew], rose[grew] = value[grew], self._updates
        rises[grew] += 1
        spreading = (rises >= RISES) & (rose > self._updates - GROWTH_CYCLES)
        self._fillable = blocks[(value >= 1) | spreading]
        keep = (peak > 0) & ((value > 0) | member(blocks, heated))
        self._blocks, self._peak, self._rose, self._rises = blocks[keep], peak[keep], rose[keep], rises[keep]

    def cut(self, regions: Sequence[Region], pinned: NDArray[np.int64], block_size: int, most: int) -> list[Region]:
        """``regions`` cut to their fillable or ``pinned`` blocks (sorted), at most ``most`` of them.

        A region loses its other blocks and splits into the runs left; each
        run keeps the region's priority in proportion to its length, so a
        plan's order is kept. Where the pieces outnumber ``most``, the
        lowest in priority are dropped.
        """
        if not self.pages:
            return list(regions)
        allowed = union(self._fillable, pinned)
        pieces: list[Region] = []
        for region in regions:
            blocks = np.arange(region.start // block_size, -(-region.end // block_size), dtype=np.int64)
            kept = member(blocks, allowed)
            if kept.all():
                pieces.append(region)
                continue
            starts, ends = runs(blocks[kept])
            for s, e in zip(starts.tolist(), ends.tolist()):
                start, stop = max(s * block_size, region.start), min(e * block_size, region.end)
                pieces.append(Region(start, stop - start, region.priority * (stop - start) / region.length))
        pieces.sort(key=lambda r: (-r.priority, r.start))
        return pieces[:most]
