"""The prefetch token bucket: how much uncached data new pins may read from the device per cycle (pure).

mlock reads every page of a new region that is not cached yet. The cycle
(:mod:`vmcache.model.cycle`) passes its plan through :meth:`PrefetchBucket.limit`,
which pays for the uncached bytes of new regions from a token bucket filled
at ``prefetch_rate`` (``warm_rate`` while a saved hot set is restored, or,
in an agent, what the host's warm-up budget grants pays for the saved set)
and cuts a region it cannot pay for whole to the chunk from its start it can.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from .blocks import BlockValues
from .params import ModelParams
from .region import Region

__all__ = ["PrefetchBucket"]


class PrefetchBucket:
    """Tokens for the device reads new pins cause; ``prefetch_rate`` None: no limit."""

    def __init__(self, params: ModelParams, prefetch_rate: int | None = None, warm_rate: int | None = None) -> None:
        self.params = params
        self.prefetch_rate = prefetch_rate
        self.warm_rate = warm_rate
        self._tokens = 0.0
        self._last_plan: float | None = None
        self.unspent = 0
        """Of the last :meth:`limit`'s ``allowance``, the bytes not spent (whole)."""

    def _rate(self, restoring: bool) -> float | None:
        """Bytes per second the bucket fills at now: ``warm_rate`` while a saved set is restored; None: no limit."""
        if self.prefetch_rate is None:
            return None
        if self.warm_rate is not None and restoring:
            return float(max(self.prefetch_rate, self.warm_rate))
        return float(self.prefetch_rate)

    def limit(self, regions: list[Region], resident: BlockValues, pinned: Sequence[Region], budget: int, now: float,
              *, restoring: bool = False, allowance: int | None = None,
              saved: Sequence[Region] | None = None) -> tuple[list[Region], int]:
        """Keep the device reads that pinning new regions causes under the prefetch rate.

        mlock reads every page of a new region that is not cached yet: the
        hot part of a disk is mostly cached already, but a large or cold
        region would be read at once, competing with the guest's own I/O.
        A token bucket (filled at :meth:`_rate`, holding at most one
        interval's worth: a quiet start never saves up a burst) pays for the
        uncached bytes of new regions, highest priority first. A region the
        tokens cannot pay for whole gets a chunk: its first blocks, as many
        as the tokens pay for (:meth:`_chunk`); the next cycles grow that
        pin until the region is whole, so a large region is loaded piece by
        piece from the first cycle. Regions below it wait (no starving a
        large region with small ones). The pinned regions a waiting region
        overlaps and its chunk does not replace stay, so a region that grows
        never loses what it had.

        ``allowance``: while restoring, the bytes the host's warm-up budget
        granted this cycle (vmcache.host.warmpool). It alone pays for the
        regions of the saved set (those overlapping ``saved``, the regions
        still to restore; None: every new region), so that the host's budget
        is what all its disks' restores read, however many they are; the
        disk's own tokens, filled at ``prefetch_rate``, pay for the rest.
        What of it the regions did not need is left in :attr:`unspent`, for
        the caller to give back.
        """
        shared = restoring and allowance is not None
        rate = self._rate(restoring and not shared)
        self.unspent = 0
        if rate is None:
            self.unspent = allowance or 0
            return regions, 0
        elapsed = self.params.interval if self._last_plan is None else max(0.0, now - self._last_plan)
        self._last_plan = now
        cap = max(float(self.params.block_size), min(float(budget), rate * self.params.interval))
        self._tokens = min(cap, self._tokens + rate * elapsed)
        pools = [self._tokens, float(allowance) if shared and allowance else 0.0]   # own, the host's grant
        current = {r.span: r for r in pinned}
        kept: dict[tuple[int, int], Region] = {}
        waiting = [0, 0]
        for region in regions:
            if region.span in current:
                kept[region.span] = region
                continue
            pool = int(shared and (saved is None or any(r.overlap(region) for r in saved)))
            part = None
            if not waiting[pool]:
                part, pools[pool] = self._chunk(region, resident, current.values(), pools[pool])
            if part is not None:
                kept[part.span] = part
            if part is None or part.span != region.span:
                waiting[pool] += 1
                for old in current.values():
                    if old.overlap(region) and (part is None or not old.overlap(part)):
                        kept.setdefault(old.span, old)
        self._tokens, self.unspent = pools[0], int(pools[1])
        return sorted(kept.values(), key=lambda r: -r.priority), sum(waiting)

    def _chunk(self, region: Region, resident: BlockValues, pins: Iterable[Region], tokens: float
               ) -> tuple[Region | None, float]:
        """The part of ``region`` from its start ``tokens`` pay for (all of it if they can; None: not a block),
        and the tokens left.

        The cost of a block is its uncached bytes (none for a block of a
        pin overlapping the region); a chunk that would end
        inside a pin overlapping the region reaches the pin's end (its bytes
        are cached), so the chunk replaces whole pins, never cuts one.
        """
        bs = self.params.block_size
        first, end = region.start // bs, -(-region.end // bs)
        lo, hi = np.searchsorted(resident.index, [first, end])
        cold = np.full(end - first, float(bs))
        cold[resident.index[lo:hi] - first] -= resident.value[lo:hi].astype(np.float64) * bs
        overlapping = sorted((pin for pin in pins if pin.overlap(region)), key=lambda r: r.start)
        for pin in overlapping:  # locked: cached, whatever the residency sample says
            cold[max(pin.start // bs, first) - first : min(-(-pin.end // bs), end) - first] = 0.0
        paid = np.cumsum(np.maximum(cold, 0.0))
        stop = min(region.end, (first + int(np.searchsorted(paid, tokens, side="right"))) * bs)
        for pin in overlapping:
            if pin.start < stop < pin.end:
                stop = min(region.end, pin.end)
        if stop <= region.start:
            return None, tokens
        blocks = -(-stop // bs) - first
        left = max(0.0, tokens - float(paid[blocks - 1]))
        return (region if stop >= region.end else Region(region.start, stop - region.start, region.priority)), left
