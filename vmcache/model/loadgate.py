"""Which partly cached blocks a new pin may fill: those the guest is still spreading through (pure).

Pinning a block mlocks all of it, so the pages of a partly cached block
that are not cached are read from the device. That pays where the guest
goes on to read them - a hot zone it covers a few pages a cycle at a time -
and is pure cost where it keeps reading the same part of the block: on the
real web server trace, pins filled 1 MiB blocks the guest reads ~44% of, and
only 1-20% of the pages they loaded were read within two minutes
(docs/benchmarks.md, issue 23's web server part).

The residency says which case a block is in. :class:`LoadGate` keeps, for
each block the guest has read part of, its peak cached fraction from the
guest's reads (not from pins: what a pin loaded says nothing about the
guest) and when it rose. A block whose peak rose in two cycles, the last
within GROWTH_CYCLES, is one the guest is spreading through: its rest is
worth loading. A block whose peak is under 1 and not rising is one the guest
reads the same part of (a burst that read part of it once rises once), or
one it left: new pins leave it out (:meth:`LoadGate.cut`), its cached pages
stay the kernel's to keep, and it is filled once it spreads again - also
after the kernel evicted it, since a re-read of the same pages sets no new
peak.

Not gated: a block fully cached (nothing to read), one inside a pin now
(already locked), one whose peak reached 1 (the guest read all of it once:
reloaded whole, as before), and one never seen cached (the margin and gaps
the planner adds around hot blocks, the next blocks of a moving hot spot).
With cache units as large as the model's blocks (the replay's default) a
block is either cached or not, its peak is 1, and nothing is gated.
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

RISES = 2
"""New peaks that make a block spreading: one is any first read of it."""


class LoadGate:
    """Per block the guest has read part of, its peak cached fraction; the blocks new pins must not fill."""

    def __init__(self) -> None:
        self._blocks = np.zeros(0, dtype=np.int64)  # sorted: the blocks tracked
        self._peak = np.zeros(0, dtype=np.float32)  # the guest's highest cached fraction of each
        self._rose = np.zeros(0, dtype=np.int64)    # the update that set it
        self._rises = np.zeros(0, dtype=np.int64)   # how many updates set a new one
        self._updates = 0
        self._stale = np.zeros(0, dtype=np.int64)

    @property
    def stale(self) -> NDArray[np.int64]:
        """The blocks the guest read part of and is not spreading through (sorted)."""
        return self._stale

    def update(self, resident: BlockValues, ours: NDArray[np.int64], heated: NDArray[np.int64]) -> None:
        """Take one cycle's residency; ``ours``: the blocks whose residency a pin caused; ``heated``: the
        blocks the model has heat for (both sorted: a block neither cached nor heated is forgotten).
        """
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
        self._stale = blocks[(value < 1) & (peak > 0) & (peak < 1) & ~spreading]
        keep = (peak > 0) & ((value > 0) | member(blocks, heated))
        self._blocks, self._peak, self._rose, self._rises = blocks[keep], peak[keep], rose[keep], rises[keep]

    def cut(self, regions: Sequence[Region], pinned: NDArray[np.int64], block_size: int, most: int) -> list[Region]:
        """``regions`` without their stale blocks outside the ``pinned`` blocks (sorted), at most ``most`` of them.

        A region loses its stale blocks and splits into the runs left; each
        run keeps the region's priority in proportion to its length, so a
        plan's order is kept. Where the pieces outnumber ``most``, the
        lowest in priority are dropped.
        """
        gated = self._stale[~member(self._stale, pinned)]
        if gated.size == 0:
            return list(regions)
        pieces: list[Region] = []
        for region in regions:
            first, end = region.start // block_size, -(-region.end // block_size)
            lo, hi = np.searchsorted(gated, [first, end])
            if lo == hi:
                pieces.append(region)
                continue
            blocks = np.arange(first, end, dtype=np.int64)
            starts, ends = runs(blocks[~member(blocks, gated[lo:hi])])
            for s, e in zip(starts.tolist(), ends.tolist()):
                start, stop = max(s * block_size, region.start), min(e * block_size, region.end)
                pieces.append(Region(start, stop - start, region.priority * (stop - start) / region.length))
        pieces.sort(key=lambda r: (-r.priority, r.start))
        return pieces[:most]
