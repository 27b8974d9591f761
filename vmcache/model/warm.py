"""WarmStart: restoring a saved hot set into one disk's heat model (pure).

A new agent that finds a saved hot set for a disk does not pin it at once:
it seeds the heat of the saved regions, and the planner, the prefetch
token bucket (``warm_rate`` while restoring, highest priority first) and the pinner do
the rest under the budget, the host cap and the free-memory floor, exactly
as for heat the guest built.

The seed is held while a region waits for its turn: until a region has
been pinned whole, its heat is kept at least at its saved heat decayed at
``pinned_decay`` since the start (the rate a pinned region with no
evidence fades at), so that a large set restored at a low prefetch rate is
not forgotten before it is read in. A saved region was *held*, so the
planner treats it as held (:meth:`WarmStart.held`, given to ``plan`` with
the pinned regions): its hysteresis applies, and a region kept at a heat
between ``threshold / keep_factor`` and ``threshold`` is restored too.
A large region comes back in chunks (the token bucket pays for one
interval's worth a cycle, vmcache.model.cycle): its pinned part counts as
restored in part (``restored_bytes``) and its seed is held until the
whole region has been pinned. Once pinned whole, a region is "restored"
and left to the model: if the guest does not read it again, its heat
decays and it is released normally. Where the guest's reads are counted,
an unread pinned block would cool at ``decay``, against ``pinned_decay``
for one the inferred path finds resident, and a set restored ahead of a
slow boot would go before it is read: until the guest reads a restored
block, :meth:`WarmStart.unread` lists it for the model to hold at
``pinned_decay`` as well. A region whose held seed falls under ``threshold / keep_factor`` is given up
(the guest has had the time to show it is not hot any more). Time is a
parameter, as everywhere in the model.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
from numpy.typing import NDArray

from .blocks import member, union
from .heat import HeatModel
from .params import ModelParams
from .region import Region

__all__ = ["WarmStart"]


class WarmStart:
    """The saved regions of one disk still to restore, and how much was.

    ``regions``: pairs of a saved byte range and its mean heat per block,
    in any order (they are restored by priority, heat summed over the
    region); ``first_read``: by span, the cycle after the last start in which
    the guest first read each (from 1; 0 or missing: not known), the order
    :meth:`by_first_read` restores them in. Raises ValueError for a negative heat.
    """

    def __init__(self, regions: Iterable[tuple[Region, float]], params: ModelParams,
                 first_read: Mapping[tuple[int, int], int] | None = None) -> None:
        bs = params.block_size
        self._params = params
        self._first = {span: cycle for span, cycle in (first_read or {}).items() if cycle > 0}
        pending = []
        for region, heat in regions:
            if heat < 0 or heat != heat:
                raise ValueError(f"saved heat must not be negative, got {heat!r}")
            if region.length > 0:
                first, end = region.start // bs, -(-region.end // bs)
                pending.append((first, end, float(heat), region, heat * (end - first)))
        pending.sort(key=lambda p: (-p[4], p[0]))
        self._pending = [(first, end, heat, region) for first, end, heat, region, _ in pending]
        self.total_bytes = sum(p[3].length for p in self._pending)
        self._whole_bytes = 0  # of the regions restored whole
        self._partial: dict[tuple[int, int], int] = {}  # span -> bytes pinned of a region restored in part
        self.given_up_bytes = 0
        self._started: float | None = None
        self._unread = np.zeros(0, np.int64)  # blocks restored whole, still pinned, not read by the guest since

    @property
    def done(self) -> bool:
        """Every saved region was restored or given up."""
        return not self._pending

    @property
    def restored_bytes(self) -> int:
        """Bytes of the saved set pinned: whole regions, and the pinned part of those restored piecewise."""
        return self._whole_bytes + sum(self._partial.values())

    @property
    def pending_bytes(self) -> int:
        return self.total_bytes - self.restored_bytes - self.given_up_bytes

    def unread(self, read: NDArray[np.int64], pinned: NDArray[np.int64]) -> NDArray[np.int64]:
        """The blocks of regions restored whole that are still ``pinned`` and not ``read`` yet (all sorted).

        A block leaves the list for good once the guest reads it or its pin goes.
        """
        self._unread = self._unread[member(self._unread, pinned) & ~member(self._unread, read)]
        return self._unread

    def by_first_read(self, regions: list[Region], now: float) -> list[Region]:
        """``regions`` (a plan) in the order the guest will want them, so that the loader stays ahead of it.

        A region over saved regions not restored yet comes at the cycle the
        guest first read them after its last start (the earliest of them);
        any other - new heat, or pinned already - at the cycle since this
        start (``now``): what the guest reads now before what it read later
        last time, after what it read earlier (and what it read in the same
        cycle). Saved regions without a first read come last; ties by
        priority. Without an order (a set
        saved before it was kept) the plan is left in its heat order.
        """
        if not self._first or not self._pending:
            return regions
        pending = sorted(self._pending, key=lambda p: p[3].start)
        starts = np.array([p[3].start for p in pending], np.int64)
        ends = np.array([p[3].end for p in pending], np.int64)
        cycles = np.array([self._first.get(p[3].span, 0) or np.inf for p in pending], np.float64) - 1.0
        lo = np.searchsorted(ends, [r.start for r in regions], side="right")
        hi = np.searchsorted(starts, [r.end for r in regions], side="left")
        since = 0.0 if self._started is None else (now - self._started) / self._params.interval
        due = [float(cycles[a:b].min()) if b > a else since for a, b in zip(lo.tolist(), hi.tolist())]
        saved = (hi > lo).tolist()
        order = sorted(range(len(regions)),
                       key=lambda i: (due[i], not saved[i], -regions[i].priority, regions[i].start))
        return [regions[i] for i in order]

    def unjudged(self) -> NDArray[np.int64]:
        """The blocks the guest has not had its chance to read yet (sorted): those of the regions not restored
        yet, and those restored whole it has not read since (as of the last :meth:`unread`)."""
        spans = [np.arange(first, end, dtype=np.int64) for first, end, _, _ in self._pending]
        blocks: NDArray[np.int64] = np.unique(np.concatenate([self._unread, *spans]))
        return blocks

    def held(self) -> list[Region]:
        """The regions not restored yet: the planner counts them as held (its ``current``)."""
        return [p[3] for p in self._pending]

    def seed(self, model: HeatModel, now: float) -> None:
        """Hold the heat of the regions not restored yet (call after each ``model.step``)."""
        if self._started is None:
            self._started = now
        p = self._params
        factor = p.pinned_decay ** (max(0.0, now - self._started) / p.interval)
        kept = []
        for first, end, heat, region in self._pending:
            held = heat * factor
            if held * p.keep_factor <= p.threshold:
                part = self._partial.pop(region.span, 0)  # what was pinned of it stays counted as restored
                self._whole_bytes += part
                self.given_up_bytes += region.length - part
                continue
            model.seed(first, end, held)
            kept.append((first, end, heat, region))
        self._pending = kept

    def update(self, pinned: NDArray[np.int64]) -> int:
        """Mark the regions the ``pinned`` blocks (sorted) cover as restored, those they cover in part as partly.

        A region is restored once all its blocks were pinned together (then
        it is left to the model); until then the bytes of its blocks pinned
        now count as restored in part. Returns the bytes of the regions
        restored whole now.
        """
        kept = []
        restored = 0
        bs = self._params.block_size
        for first, end, heat, region in self._pending:
            covered = int(np.searchsorted(pinned, end) - np.searchsorted(pinned, first))
            self._partial.pop(region.span, None)
            if covered == end - first:
                restored += region.length
                self._unread = union(self._unread, np.arange(first, end, dtype=np.int64))
                continue
            if covered:
                self._partial[region.span] = min(region.length, covered * bs)
            kept.append((first, end, heat, region))
        self._pending = kept
        self._whole_bytes += restored
        return restored

