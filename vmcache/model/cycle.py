"""One cycle of one disk around the model, without the host (pure).

What the engine (vmcache.service.engine), the replay (vmcache.replay.sim)
and the tests all run, so that replay figures are evidence about the
engine. Per cycle, given what the host sampled (residency, the blocks the
guest wrote, read evidence of pinned blocks, the regions pinned now),
:meth:`Cycle.step`:

1. updates which residency is *ours*: blocks pinned now, or pinned earlier
   and not evicted since (a block stops being ours once the kernel evicted
   it: when it comes back, the guest read it). Ours is masked out of the
   model's residency input, otherwise pinned regions feed themselves and
   creep over the disk;
2. counts the read-miss bytes: residency that appeared since the previous
   cycle, not by vmcache's hand nor by writes; a block that took many times
   its fair share of the cycle's reads (``miss_contrast``) counts as
   resident for the model, so a slow guest's hot set shows before its
   pages fill the blocks; where the pinned blocks' read evidence is too
   weak to hold any of them, it is judged the same way (capped), so a slow
   guest's pins stay while it reads them;
3. steps the :class:`~vmcache.model.heat.HeatModel` at ``now`` and, while a
   saved hot set is being restored (``warm``), holds its seeded heat;
4. plans the regions to pin (:func:`~vmcache.model.planner.plan`, the
   pinned regions as ``current`` for hysteresis, own heat for trimming);
5. leaves out of new regions the blocks that are neither cached whole nor
   spread through by the guest (:mod:`vmcache.model.loadgate`), except
   while a saved hot set is restored;
6. cuts new regions to the chunks whose uncached bytes the prefetch token
   bucket can pay for (:mod:`vmcache.model.prefetch`: ``prefetch_rate``,
   ``warm_rate`` while restoring), highest priority first - while a saved
   set is restored, in the order its guest first read it after its last
   start (:meth:`~vmcache.model.warm.WarmStart.by_first_read`); the rest
   waits for the next cycles.

Steps 5 and 6 keep pins from reading what the guest will not use. Pins
that read nothing (``fill`` False, host config ``fill: cached``) skip both
but while a saved hot set is restored, which is loaded whole (and paced).

Where the guest's reads are counted exactly (``reads``, a
:class:`~vmcache.model.reads.GuestReads` from the kernel or a trace), steps
1-2 are not needed and not taken: a block's read input is how often the
guest read it, pinned or not, the read misses are the counted ones, and
writes count by the share of written blocks the guest reads back
(:mod:`vmcache.model.exact`). Counted, they also go to the tally a saved hot
set ranks blocks by (:mod:`vmcache.model.saveset`).

The caller pins (or simulates pinning) the regions and tells the cycle what
ended up pinned with :meth:`Cycle.pinned`, which marks it ours (and
restored, for a warm start). No clock, no I/O: time is the ``now`` argument.

Every array of a step lists only the blocks resident, written, pinned or
with heat (:class:`~vmcache.model.blocks.BlockValues`, sorted block
indices): a 64 TiB thin disk costs what a 64 GiB one does when the guest
touches the same data. The replay and the tests may pass dense per-block
arrays instead; they are converted at the door.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

from .blocks import BlockValues, blocks_of, listed, member, union
from .exact import PinShare, ReadBack, read_input
from .heat import HeatModel
from .inferred import held_evidence, relative_reads
from .loadgate import LoadGate
from .params import PAGE_SIZE, ModelParams
from .pinvalue import PinValue
from .planner import plan_active
from .prefetch import PrefetchBucket
from .reads import GuestReads
from .saveset import ReadTally
from .region import Region
from .warm import WarmStart

__all__ = ["Cycle", "CycleResult", "EVIDENCE_SAMPLES", "evidence_per_block"]

EVIDENCE_SAMPLES = 4096
"""Most pinned pages whose referenced bit one cycle of one disk looks at."""


def evidence_per_block(pinned_blocks: int) -> int:
    """Pages to sample per pinned block: 16, fewer when much is pinned (EVIDENCE_SAMPLES in all).

    A page lookup costs ~3 us, so the sample is bounded per cycle, not per block.
    """
    return max(1, min(16, EVIDENCE_SAMPLES // max(1, pinned_blocks)))


@dataclass(frozen=True)
class CycleResult:
    """What one :meth:`Cycle.step` decided."""

    regions: list[Region]
    """The regions to pin, highest priority first (the pinned set the caller should reach)."""
    read_miss_bytes: int
    """Bytes that appeared in the cache since the previous step, not by vmcache's hand nor by writes."""
    waiting: int = 0
    """New regions held back by the prefetch limit (their overlapped pins stay in ``regions``)."""


class Cycle:
    """The per-disk state between cycles: heat model, ours mask, previous residency, prefetch tokens.

    ``prefetch_rate``: bytes per second of uncached data new regions may
    pull in (a token bucket holding one interval's worth); None for no
    limit. ``warm_rate``: the rate instead while a saved hot set is being
    restored (the higher of the two applies; None: ``prefetch_rate``).
    ``residency_unit``: the bytes the residency counts in (a page on a
    host; the replay's cache unit); the load gate needs it smaller than a
    block. ``fill`` False: new pins lock only what is cached and read
    nothing, so neither the load gate nor the prefetch limit applies to
    them. Raises ValueError (from HeatModel) for a negative ``nblocks``.
    """

    def __init__(self, params: ModelParams, nblocks: int = 0, *, prefetch_rate: int | None = None,
                 warm_rate: int | None = None, residency_unit: int = PAGE_SIZE, fill: bool = True) -> None:
        self.params = params
        self.bucket = PrefetchBucket(params, prefetch_rate, warm_rate)
        self.fill = fill
        self.model = HeatModel(params, nblocks)
        self._ours = np.zeros(0, dtype=np.int64)  # sorted blocks
        self._prev: BlockValues | None = None
        self.read_back = ReadBack()
        """The share of written blocks the guest reads back (exact path)."""
        self.pin_share = PinShare()
        """The share of the pin budget used, balanced against the kernel's cache (exact path)."""
        self.load_gate = LoadGate(pages=residency_unit < params.block_size)
        """The blocks new pins may fill: cached whole, or spread through by the guest."""
        self.warm: WarmStart | None = None
        """A saved hot set being restored (set before the first step), None without one."""
        self.warm_allowance: int | None = None
        """Bytes the host's warm-up budget granted the next step's restore (None: filled at warm_rate)."""
        self.tally = ReadTally()
        """The guest's counted reads per block over hours: what a saved hot set ranks by."""
        self.pin_value = PinValue(nblocks)
        """The counted reads the pins served that the kernel alone would likely have missed."""

    @property
    def restoring(self) -> bool:
        """A saved hot set is being restored: its pins are loaded on purpose."""
        return self.warm is not None and not self.warm.done

    @property
    def loads(self) -> bool:
        """New pins read what is not cached: ``fill``, or a saved hot set being restored."""
        return self.fill or self.restoring

    @property
    def nblocks(self) -> int:
        return self.model.nblocks

    @property
    def ours(self) -> NDArray[np.bool_]:
        """Per block, whether vmcache caused its residency (dense, a new array: pictures and tests)."""
        mask = np.zeros(self.nblocks, dtype=bool)
        mask[self._ours] = True
        return mask

    @property
    def ours_blocks(self) -> NDArray[np.int64]:
        """The blocks whose residency vmcache caused (sorted, read-only)."""
        view = self._ours.view()
        view.flags.writeable = False
        return view

    def resize(self, nblocks: int) -> bool:
        """Follow the disk to ``nblocks`` blocks (heat and ours of surviving blocks kept); True if it changed.

        Raises ValueError for a negative ``nblocks``.
        """
        if nblocks == self.nblocks:
            return False
        self.model.resize(nblocks)
        self.tally.resize(nblocks)
        self.pin_value.resize(nblocks)
        self._ours = self._ours[self._ours < nblocks]
        self._prev = None
        return True

    def step(
        self,
        residency: BlockValues | ArrayLike,
        written: BlockValues | ArrayLike,
        pinned: Sequence[Region],
        *,
        size_bytes: int,
        budget: int,
        now: float,
        seen: BlockValues | ArrayLike | None = None,
        seen_sample: int | None = None,
        reads: GuestReads | None = None,
        recharge: bool = False,
    ) -> CycleResult:
        """One cycle: ours, read misses, model step, plan, prefetch limit (see the module docstring).

        ``residency``: the blocks in the page cache (any cause) and the
        fraction of each; ``written``: the blocks the guest wrote since the
        last step and the fraction of each; ``pinned``: the regions pinned
        now; ``seen``: read evidence of the pinned blocks, or None;
        ``seen_sample``: how many pages of each pinned block that evidence
        was sampled from (None: all of them). Each array may be dense
        per-block instead (NaN where ``seen`` has none). ``reads``: the
        guest's reads of the cycle counted exactly (:meth:`_exact`), or None
        to infer them from residency and ``seen`` as above. ``recharge``: new pins read
        all their bytes, cached or not (the pinner's ``recharge``), so the
        prefetch limit pays for all of them. Raises ValueError for a dense
        array that is not ``(nblocks,)``, blocks unsorted, repeated or past
        the disk, or a ``now`` that is not finite.
        """
        n = self.nblocks
        res, wr = listed(residency, n, "residency"), listed(written, n, "written")
        evidence = None if seen is None else listed(seen, n, "seen", nan_is_none=True)
        kept = self._ours[member(self._ours, res.index)]  # evicted: not ours any more
        pinned_blocks = blocks_of(pinned, self.params.block_size, n)
        self._ours = union(kept, pinned_blocks)
        self.load_gate.update(res, self._ours, self.model.active.blocks)
        read_miss, grown = self._read_miss(res, wr, size_bytes)
        if reads is not None:
            pages, missed = listed(reads.pages, n, "reads.pages"), listed(reads.missed, n, "reads.missed")
            self.tally.add(pages, now, missed)
            self.pin_value.add(pages, missed, pinned_blocks, now)
        if reads is None:
            judged, evidence = self._relative_reads(res, grown, evidence, seen_sample)
            self.model.step_blocks(judged, wr, self._masked(), now, seen=evidence)
        else:
            read_input, wr, read_miss = self._exact(reads, wr, size_bytes)
            unread = np.zeros(0, np.int64) if self.warm is None else self.warm.unread(
                read_input.index[read_input.value > 0], pinned_blocks)
            self.model.step_blocks(read_input, wr, unread, now)  # a restored block not read yet: held
        if self.warm is not None:
            self.warm.seed(self.model, now)
        regions, waiting = self._plan(res, pinned, pinned_blocks, size_bytes=size_bytes, budget=budget, now=now,
                                      reads=reads, recharge=recharge)
        return CycleResult(regions, read_miss, waiting)

    def _plan(self, res: BlockValues, pinned: Sequence[Region], pinned_blocks: NDArray[np.int64], *,
              size_bytes: int, budget: int, now: float, reads: GuestReads | None,
              recharge: bool) -> tuple[list[Region], int]:
        """Steps 4-6 (module docstring) on the stepped model: the regions to pin, and how many wait."""
        held = pinned if self.warm is None else [*pinned, *self.warm.held()]  # saved regions count as held
        regions = plan_active(self.model.active, params=self.params, size_bytes=size_bytes, budget=budget,
                              current=held)
        if reads is not None:
            regions = self._balanced(regions, reads, res, size_bytes, budget, held)
        waiting = 0
        if self.fill and not self.restoring:  # steps 5 and 6: only where pins read
            regions = self.load_gate.cut(regions, pinned_blocks, self.params.block_size, self.params.max_regions)
        if self.warm is not None and self.restoring:  # paid for in the order the guest read them last time
            regions = self.warm.by_first_read(regions, now)
        if self.loads:
            paid = BlockValues.empty() if recharge else res  # what new pins read: their uncached bytes, or all
            regions, waiting = self.bucket.limit(regions, paid, pinned, budget, now, restoring=self.restoring,
                                                 allowance=self.warm_allowance,
                                                 saved=self.warm.held() if self.warm is not None else None)
        return regions, waiting

    def pinned(self, regions: Iterable[Region]) -> None:
        """What the caller pinned after this step: its residency is ours from now on."""
        blocks = blocks_of(regions, self.params.block_size, self.nblocks)
        self._ours = union(self._ours, blocks)
        if self.warm is not None and not self.warm.done:
            self.warm.update(blocks)

    def _exact(self, reads: GuestReads, written: BlockValues, size: int) -> tuple[BlockValues, BlockValues, int]:
        """The model's read and write inputs and the read-miss bytes, from the reads counted exactly.

        The read input is :func:`~vmcache.model.exact.read_input`; the
        write input is weighed by the share of written blocks the guest
        reads back (:class:`ReadBack`): writes nobody reads again earn no pin.
        """
        n = self.nblocks
        pages = listed(reads.pages, n, "reads.pages")
        missed = listed(reads.missed, n, "reads.missed")
        share = self.read_back.update(written.index[written.value > 0], pages.index)
        weighed = BlockValues(written.index, written.value * np.float32(share))
        miss_bytes = int(float(missed.value.sum(dtype=np.float64))) * PAGE_SIZE
        return read_input(pages, self.params, n), weighed, min(size, miss_bytes)

    def _balanced(self, wanted: list[Region], reads: GuestReads, resident: BlockValues, size: int, budget: int,
                  held: Sequence[Region]) -> list[Region]:
        """The plan under the share of the budget the misses say pins are worth (:class:`PinShare`)."""
        missed = listed(reads.missed, self.nblocks, "reads.missed")
        share = self.pin_share.update(missed.index, missed.value)
        regions = wanted
        if share < 1.0:
            regions = plan_active(self.model.active, params=self.params, size_bytes=size,
                                  budget=int(budget * share), current=held)
        self.pin_share.remember_plans(wanted, regions, resident, self.params.block_size, self.nblocks)
        return regions

    def _masked(self) -> NDArray[np.int64]:
        """The blocks the model must not take residency from (ours; sorted)."""
        return self._ours

    def _read_miss(self, resident: BlockValues, written: BlockValues, size: int
                   ) -> tuple[int, NDArray[np.float32] | None]:
        """Bytes that appeared in the cache since the last step, not by our hand nor by writes.

        Also the growth per block of ``resident`` (fractions, 0 where ours),
        None on the first step: there is nothing to compare with (the
        residency found then may be old: a restarted agent finds the cache
        its predecessor saw, a finished backup's pages included).
        """
        prev, self._prev = self._prev, resident
        if prev is None:
            return 0, None
        blocks = resident.index  # only a resident block can have grown
        grown = resident.value - prev.at(blocks) - written.at(blocks)
        grown[member(blocks, self._ours)] = 0.0
        np.maximum(grown, 0.0, out=grown)
        return min(size, int(float(grown.sum(dtype=np.float64)) * self.params.block_size)), grown

    def _relative_reads(self, resident: BlockValues, grown: NDArray[np.float32] | None,
                        seen: BlockValues | None, sample: int | None = None
                        ) -> tuple[BlockValues, BlockValues | None]:
        """The model's residency and evidence on the inferred path (:func:`~vmcache.model.inferred.relative_reads`)."""
        return relative_reads(self.params, self.nblocks, resident, grown, seen, sample, held=self._held_evidence)

    def _held_evidence(self, seen: BlockValues, scale: np.float32, sample: int | None = None) -> BlockValues:
        """The pinned blocks' evidence where too weak to hold a pin (:func:`~vmcache.model.inferred.held_evidence`)."""
        return held_evidence(self.params, seen, scale, sample)
