"""One disk's cycle: sample residency and writes, update the heat, plan, pin.

:class:`DiskEngine` owns the per-disk state that links the pure model to the
host: the open image, the :class:`~vmcache.model.heat.HeatModel`, the
:class:`~vmcache.host.pinner.Pinner`, and the mask of blocks whose residency
vmcache caused. It has no loop and no clock of its own: the caller (the
standalone ``vmcache watch`` or the per-domain agent) calls :meth:`cycle`
once per interval and decides what to do with the :class:`CycleStats`.

Which residency counts as the guest's: blocks vmcache pinned, and blocks it
pinned earlier that are still resident, are "ours" and masked out of the
model's residency input (otherwise pinned regions feed themselves and creep
over the disk). A block stops being ours once the kernel has evicted it:
when it comes back, the guest read it.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import datetime
from collections.abc import Callable, Sequence

import numpy as np

from ..errors import PageCacheError
from ..observe.heatmap.data import HeatmapData
from ..host.meminfo import MemInfo, read_meminfo
from ..host.pagecache import Residency, scan_residency
from ..host.pagerefs import PageRefs
from ..host.pinner import Pinner, PinReport
from ..logfmt import event
from ..model.blocks import BlockValues, binned, blocks_mask, blocks_of, member
from ..model.cycle import Cycle, evidence_per_block
from ..model.extents import BitmapRead, DirtyRead, extents_to_block_values
from ..model.params import PAGE_SIZE, ModelParams
from ..model.pinvalue import PinValue
from ..model.reads import GuestReads
from ..model.region import Region
from ..model.share import Curve, demand_of
from ..model.stats import CycleStats
from ..model.saveset import carried_regions, saved_regions
from ..model.warm import WarmStart
from .enginepolicy import EnginePolicy
from .warmbudget import WarmBudget

PICTURE_BLOCKS = 1 << 20
"""Most blocks a heat-map picture of one disk is given (1 TiB of 1 MiB blocks); see heatmap_data."""

__all__ = ["DiskEngine", "ReadSource", "WriteSource"]

WriteSource = Callable[[], DirtyRead]
#: The guest's reads since the last call, per block below the given count; None when not known this cycle.
ReadSource = Callable[[int], "GuestReads | None"]


class DiskEngine:
    """Heat model and pinning for one image file, advanced one :meth:`cycle` at a time."""

    def __init__(
        self,
        image: str | os.PathLike[str],
        *,
        params: ModelParams,
        budget: int,
        policy: EnginePolicy,
        writes: WriteSource | None = None,
        reads: ReadSource | None = None,
        pinner: Pinner | None = None,
        refs: PageRefs | None = None,
        clear_refs: bool = True,
        meminfo: Callable[[], MemInfo] = read_meminfo,
        clock: Callable[[], float] = time.monotonic,
        logger: logging.Logger | None = None,
    ) -> None:
        """Open ``image``; nothing is pinned until the first cycle.

        ``policy``: the memory the pins may take and how they are filled
        (:class:`~vmcache.service.enginepolicy.EnginePolicy`). ``refs`` reads
        the referenced bits of pinned pages (the guest's reads of them);
        ``reads`` counts every read the guest made (host/readcount.py; None:
        inferred from residency growth and referenced bits);
        ``clear_refs``: clear them at the end of each cycle - an agent
        running several engines clears once, after all of them. Raises
        PageCacheError when the image cannot be opened.
        """
        self.image = os.fspath(image)
        self.params = params
        self.budget = budget
        self._writes = writes
        self._reads = reads
        self._decide_on_reads = policy.decide_on_reads
        self._meminfo = meminfo
        self._clock = clock
        self._log = logger or logging.getLogger(__name__)
        try:
            self._fd = os.open(self.image, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as err:
            raise PageCacheError(f"cannot open image: {os.strerror(err.errno or 0)}", path=self.image,
                                 errno=err.errno) from err
        self._refs = refs if refs is not None else PageRefs()
        self._clear_refs = clear_refs
        self._pinner = pinner or Pinner(self.image, floor_bytes=policy.floor_bytes, meminfo=meminfo,
                                        room=policy.room, apart=policy.apart, logger=self._log)
        self._cycle = Cycle(params, prefetch_rate=policy.prefetch_rate, warm_rate=policy.warm_rate,
                            fill=policy.fill)
        self._warm_budget = (WarmBudget(policy.warm_pool, self._fd, self.image, params, self._log, policy.domain)
                             if policy.warm_pool is not None and policy.prefetch_rate is not None else None)
        self._written = BlockValues.empty()
        self.last_reads: GuestReads | None = None
        """The guest's reads counted in the last cycle (None: not counted)."""
        self._cycles = 0
        self._recharge = False  # new pins read all their pages in: QEMU is under a limit the agent is not
        self.residency: Residency | None = None
        self.last: CycleStats | None = None

    def track(self, writes: WriteSource | None) -> None:
        """Read the guest's writes from ``writes`` from the next cycle on (None: the file is read-only now)."""
        self._writes = writes

    def count_reads(self, reads: ReadSource | None) -> None:
        """Take the guest's reads from ``reads`` from the next cycle on (None: infer them)."""
        self._reads = reads

    @property
    def warm(self) -> WarmStart | None:
        """A saved hot set being restored (set before the first cycle), None without one."""
        return self._cycle.warm

    @warm.setter
    def warm(self, warm: WarmStart | None) -> None:
        self._cycle.warm = warm

    # What the heat map and status show -------------------------------------------------

    @property
    def heat(self) -> np.ndarray:
        """Heat per block, dense (empty before the first cycle; O(nblocks): for pictures)."""
        return self._cycle.model.heat

    def hot_regions(self, *, recent: bool = False) -> list[Region]:
        """What a hot set saves: the blocks the guest read most, up to the budget (vmcache.model.saveset),
        with ``recent`` what a migration carries (the blocks the guest goes back to, those it reads now first;
        vmcache.model.saveset ``carried_regions``); empty before the first cycle."""
        if self.residency is None:
            return []
        tally, active, size = self._cycle.tally, self._cycle.model.active, self.residency.size_bytes
        if recent:
            warm = self._cycle.warm
            return carried_regions(tally, active, self.params, budget=self.budget, size_bytes=size,
                                   unjudged=None if warm is None else warm.unjudged())
        return saved_regions(tally.counts, active, self.params, budget=self.budget, size_bytes=size)

    def first_reads(self, regions: Sequence[Region]) -> tuple[int, ...]:
        """Per region, the cycle since this start in which the guest first read it (from 1; 0: not read)."""
        return self._cycle.tally.first_cycles(regions, self.params)

    def demand(self, budget: int) -> Curve:
        """This disk's demand curve after its last cycle: its plan at ``budget`` (the full one, not the grant).

        Empty before the first cycle. Raises ValueError for a negative budget.
        """
        if self.residency is None:
            return ()
        return demand_of(self._cycle.model.active, self.params, size_bytes=self.residency.size_bytes, budget=budget,
                         current=self._pinner.pinned)

    def pinned_mask(self) -> np.ndarray:
        return blocks_mask(self._pinner.pinned, self.params.block_size, self._cycle.nblocks)

    def heatmap_data(self, disk: str, *, title: str = "") -> HeatmapData:
        """This disk's state as the heat-map picture draws it (after at least one cycle).

        At most PICTURE_BLOCKS blocks: a larger disk is shown in coarser
        blocks (its heat the hottest of theirs, residency and writes their
        mean, pinned if any is), so that asking a 64 TiB disk for a picture
        costs what a 1 TiB one does, not gigabytes of per-block arrays.
        """
        n = self._cycle.nblocks
        factor = max(1, -(-n // PICTURE_BLOCKS))
        size = self.residency.size_bytes if self.residency else 0
        resident = self.residency.blocks if self.residency else BlockValues.empty()
        guest = np.where(member(resident.index, self._cycle.ours_blocks), np.float32(0.0), resident.value)
        active = self._cycle.model.active
        pinned = blocks_of(self._pinner.pinned, self.params.block_size, n)
        read = None
        if self.last_reads is not None:
            pages = self.last_reads.pages
            per_block = self.params.block_size // PAGE_SIZE
            read = binned(BlockValues(pages.index, np.minimum(pages.value / per_block, 1.0)), factor, n)
        return HeatmapData(
            heat=binned(BlockValues(active.blocks, active.heat), factor, n, hottest=True),
            pinned=binned(BlockValues(pinned, np.ones(pinned.size, np.float32)), factor, n, hottest=True) > 0,
            resident=binned(BlockValues(resident.index, guest), factor, n),
            written=binned(self._written, factor, n), read=read, block_size=self.params.block_size * factor,
            image_size=size, disk=disk, title=title, image=self.image, when=datetime.now())

    # The cycle --------------------------------------------------------------------------

    @property
    def pin_value(self) -> PinValue | None:
        """What the pins saved, judged on the counted reads (None where the cycle infers reads)."""
        return self._cycle.pin_value if self._decide_on_reads and self.last_reads is not None else None

    def cycle(self) -> CycleStats:
        """Sample, run the pure cycle (vmcache.model.cycle), apply; return what happened.

        Raises PageCacheError when the image cannot be scanned (the pinned
        set is left as it was) and PinError when the pinner fails.
        """
        started = self._clock()
        bs = self.params.block_size
        res = scan_residency(self.image, bs, fd=self._fd, hint=self.residency)
        self.residency = res
        n = res.nblocks
        if self._cycle.resize(n) and self._cycles:
            self._log.info(event("disk.resize", image=self.image, blocks=n))

        self.last_reads = self._reads(n) if self._reads else None
        sample = self._writes() if self._writes else DirtyRead(BitmapRead.NONE)
        self._written = written = extents_to_block_values(sample.extents, bs, n)
        if not self._cycle.fill:
            self._pinner.lock_cached()  # the guest's reads into the pins: locked, and seen as read evidence
        current = self._pinner.pinned
        per_block = evidence_per_block(blocks_of(self._pinner.pinned, bs, n).size)
        exact = self.last_reads if self._decide_on_reads else None
        seen = None
        if exact is None:  # counted reads include the pinned blocks': no referenced bits needed
            seen = self._pinner.read_evidence(bs, n, self._refs, per_block=per_block, phase=self._cycles)
        self._cycles += 1
        now = self._clock()
        recharge = self._cycle.loads and self._pinner.charges_apart()
        if recharge != self._recharge:
            self._log.info(event("pin.charged_to", who="agent" if recharge else "first reader"))
            self._recharge = recharge
        if self._warm_budget is not None:  # a restore is paid from the host's warm-up budget
            self._cycle.warm_allowance = self._warm_budget.grant(self._cycle.warm)
        decided = self._cycle.step(res.blocks, written, current, size_bytes=res.size_bytes,
                                   budget=self.budget, now=now, seen=seen, seen_sample=per_block,
                                   reads=exact, recharge=recharge)
        if self._warm_budget is not None:
            self._warm_budget.settle(self._cycle.bucket.unspent)
        if decided.waiting:
            self._log.debug(event("prefetch.wait", regions=decided.waiting))
        report = self._pinner.apply(decided.regions, self.budget, fill=self._cycle.loads, recharge=recharge)
        if recharge:  # pins made before QEMU came under its limit: at the pace new pins may load
            rate = self._cycle.bucket.prefetch_rate
            self._pinner.recharge(None if rate is None else int(rate * self.params.interval))
        self._settle(report.regions)
        if self._clear_refs:
            self._refs.clear()  # also forgets the references mlock itself just made

        self.last = self._record(started, res, sample, decided.read_miss_bytes, report)
        return self.last

    def _record(self, started: float, res: Residency, sample: DirtyRead, read_miss_bytes: int,
                report: PinReport) -> CycleStats:
        """The figures of the cycle that began at ``started``, logged at debug level."""
        ended = self._clock()
        stats = CycleStats(
            now=ended,
            duration_seconds=ended - started,
            size_bytes=res.size_bytes,
            budget_bytes=self.budget,
            pinned_bytes=report.pinned_bytes,
            locked_bytes=report.locked_bytes,
            agent_charged_bytes=self._pinner.agent_charged_bytes,
            pinned_regions=len(report.regions),
            resident_bytes=res.resident_bytes,
            guest_written_bytes=sample.bytes,
            guest_read_miss_bytes=read_miss_bytes,
            recently_evicted_pages=res.nr_recently_evicted,
            bitmap_read=sample.status,
            mem_available_bytes=self._meminfo().available_bytes,
            backing_off=bool(report.under_floor or report.skipped_for_floor or report.released_for_pressure),
            skipped_for_floor_bytes=report.skipped_for_floor,
            warm_restored_bytes=self.warm.restored_bytes if self.warm else 0,
            warm_total_bytes=self.warm.total_bytes if self.warm else 0,
            error=sample.error,
        )
        self._log.debug(event("cycle", pinned=stats.pinned_bytes, regions=stats.pinned_regions,
                              resident=stats.resident_bytes, written=stats.guest_written_bytes,
                              read_miss=read_miss_bytes, seconds=f"{stats.duration_seconds:.4f}"))
        return stats

    def _settle(self, pinned: Sequence[Region]) -> None:
        """Tell the cycle what is pinned now; log when that completed a warm start."""
        warm = self.warm
        if warm is None or warm.done:
            self._cycle.pinned(pinned)
            return
        before = warm.restored_bytes
        self._cycle.pinned(pinned)
        if warm.done:
            self._log.info(event("warm.done", image=self.image, restored=warm.restored_bytes,
                                 given_up=warm.given_up_bytes, total=warm.total_bytes))
        elif warm.restored_bytes != before:  # restored piecewise: one line a step
            self._log.info(event("warm.progress", image=self.image, restored=warm.restored_bytes,
                                 total=warm.total_bytes))

    def close(self) -> None:
        """Unpin everything, give up any ask of the warm-up budget, close the image."""
        try:
            if self._warm_budget is not None:
                self._warm_budget.close()
            self._pinner.close()
        finally:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> DiskEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
