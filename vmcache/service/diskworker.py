"""One managed disk of a domain: write tracker + engine + metrics + status.

The agent keeps one :class:`DiskWorker` per eligible disk. A worker turns
the tracker's dirty-bitmap reads into the engine's write samples, runs one
engine cycle when asked, and keeps the disk's metrics and status current.
Errors of one cycle are recorded, never raised: one broken disk must not
stop the agent from serving the others.
"""

from __future__ import annotations

import logging
import os
import time

from .engine import DiskEngine, ReadSource
from .enginepolicy import EnginePolicy
from ..model.share import Curve
from ..errors import HostError, MonitorError, MonitorRunOverError, TrackerError, VmcacheError
from ..host.pagerefs import PageRefs
from ..host.qmp import Monitor
from ..host.readcount import FileReads
from ..host.tracker import DirtyTracker
from ..logfmt import event
from ..observe.heatmap import HeatmapData, HeatmapWriter
from ..observe.metrics import AgentMetrics, DiskMetrics
from ..model.extents import BitmapRead, DirtyRead
from ..model.params import PAGE_SIZE, ModelParams
from ..model.pinvalue import PinCost, PinWorth
from ..model.reads import GuestReads
from ..settings.policy import DiskChoice
from ..model.stats import CycleStats
from ..observe.status import DiskStatus
from .readsignal import ReadSignal

__all__ = ["DiskWorker"]


class DiskWorker:
    """Tracker and engine of one disk; ``cycle()`` once per interval, ``close()`` at the end.

    ``node`` is the image's storage node in QEMU (None: no write tracking,
    e.g. the node could not be found; the disk is still managed from
    residency alone).
    """

    def __init__(
        self,
        choice: DiskChoice,
        *,
        node: str | None,
        monitor: Monitor,
        params: ModelParams,
        policy: EnginePolicy,
        refs: PageRefs | None = None,
        runtime_dir: str,
        socket_owner: tuple[int, int] | None = None,
        granularity: int,
        metrics: AgentMetrics,
        logger: logging.Logger,
        heatmap: HeatmapWriter | None = None,
        engine_factory: type[DiskEngine] = DiskEngine,
        layer_of: str | None = None,
        reads: ReadSignal | None = None,
    ) -> None:
        """Start tracking; raises VmcacheError when the image cannot be opened.

        ``policy``: the engine's memory limits and fill, as the host config says;
        ``reads``: the agent's read counter (None: the guest's reads are inferred);
        ``heatmap`` writes the disk's heat-map files after its cycles;
        ``layer_of``: the image is a read-only backing layer of that target's
        top image (no tracker: give ``node`` None).
        """
        disk = choice.disk
        assert disk.source is not None
        self.target = disk.target
        self.image = disk.source
        self.budget = choice.budget
        self._log = logger
        self._metrics: DiskMetrics = metrics.disk(self.target, self.image, layer=layer_of is not None)
        self._agent_metrics = metrics
        self.status = DiskStatus(target=disk.target, source=disk.source, cache=disk.cache_mode, eligible=True,
                                 budget_bytes=choice.budget, dirty_granule_bytes=granularity if node else None,
                                 layer_of=layer_of)
        self.tracker = (self._start_tracker(DirtyTracker(monitor, node, granularity=granularity,
                                                         runtime_dir=runtime_dir, socket_owner=socket_owner,
                                                         logger=logger))
                        if node is not None else None)
        self._file_reads: FileReads | None = reads.watch(self.image, params.block_size) if reads else None
        self._dropped = 0
        self._pressure = policy.pressure
        self._cost = PinCost()
        self._told = (0, 0)  # bytes saved and cost reported so far
        try:
            self.engine = engine_factory(self.image, params=params, budget=choice.budget, policy=policy, refs=refs,
                                         clear_refs=False, writes=self._writes if self.tracker else None,
                                         reads=self._read_source(), logger=logger)
        except BaseException:
            self._close_reads()
            raise
        self._heatmap = heatmap
        self._last_cycle: float | None = None
        self.failing = False  # the last cycle failed or could not read the writes
        self._inode = _open_inode(self.image)  # tells, whatever its path, whether a path still names the file
        self._qemu_writes = True  # the last cycle saw guest writes (a deleted image is kept while it does)

    def _start_tracker(self, tracker: DirtyTracker) -> DirtyTracker | None:
        """``tracker`` started, or None when it could not be (recorded: the disk is managed without writes)."""
        try:
            tracker.start()
        except VmcacheError as err:
            self._record_error(err, "tracker.start_failed")
            return None
        self.status.dirty_granule_bytes = tracker.granularity  # coarser on a huge disk
        return tracker

    def _writes(self) -> DirtyRead:
        assert self.tracker is not None
        try:
            read = self.tracker.read()
        except MonitorRunOverError as err:  # the domain stopped mid-cycle: the agent ends at its next look
            self._log.info(event("tracker.run_over", disk=self.target, error=err))
            return DirtyRead(BitmapRead.DEFERRED, reason=str(err))
        except (TrackerError, MonitorError) as err:  # BitmapReadError among them: bitmaps kept for later
            self._record_error(err, "tracker.read_failed")
            return DirtyRead(BitmapRead.FAILED, reason=str(err))
        return read

    def _read_source(self) -> ReadSource | None:
        return self._take_reads if self._file_reads is not None else None

    def _take_reads(self, nblocks: int) -> GuestReads | None:
        """The guest's reads since the last cycle; None when the counts cannot be read (this cycle infers)."""
        if self._file_reads is None:
            return None
        try:
            reads = self._file_reads.take(nblocks)
        except VmcacheError as err:
            self._record_error(err, "reads.take_failed")
            return None
        if self._file_reads.dropped > self._dropped:
            self._log.warning(event("reads.dropped", disk=self.target, image=self.image,
                                    blocks=self._file_reads.dropped - self._dropped))
        return reads

    def _record_error(self, err: BaseException, name: str) -> None:
        self._log.warning(event(name, disk=self.target, error=err))
        self._metrics.count_error(err)
        self.status.error = str(err)

    def cycle(self, budget: int) -> CycleStats | None:
        """Run one engine cycle under ``budget`` bytes; None when it failed (recorded).

        A deleted image (no path names it) is reported, and pinned only while QEMU still writes it.
        """
        if self._check_deleted() and not self._qemu_writes:
            budget = 0
        self.engine.budget = budget
        try:
            stats = self.engine.cycle()
        except VmcacheError as err:
            self._record_error(err, "disk.cycle_failed")
            self.failing = True
            return None
        self.failing = stats.error is not None
        self._qemu_writes = stats.guest_written_bytes > 0
        now = time.monotonic()
        elapsed = now - self._last_cycle if self._last_cycle is not None else stats.duration_seconds
        self._last_cycle = now
        self._metrics.observe(stats)
        self.status.update(stats, elapsed=elapsed, wall_time=time.time())
        reads = self.engine.last_reads
        if reads is not None and self._file_reads is not None:
            pages, hits = reads.totals()
            dropped, self._dropped = self._file_reads.dropped - self._dropped, self._file_reads.dropped
            worth = self._worth(stats.pinned_bytes)
            self._metrics.observe_reads(pages * PAGE_SIZE, hits * PAGE_SIZE, dropped, worth)
            self.status.update_reads(pages * PAGE_SIZE, hits * PAGE_SIZE, elapsed=elapsed, worth=worth)
        return stats

    def _worth(self, pinned_bytes: int) -> PinWorth | None:
        """What the pins were worth in the last cycle, where the counted reads decide (None elsewhere)."""
        value = self.engine.pin_value
        if value is None:
            return None
        cost = None
        if self._pressure is not None:
            try:
                refaulted, files = self._pressure()
                self._cost.add(refaulted, files, pinned_bytes, own=value.reread_missed)
                cost = int(self._cost.cost_pages * PAGE_SIZE) - self._told[1]
            except HostError as err:
                self._log.debug(event("pin.cost_unknown", disk=self.target, error=err))
        saved = int(value.saved_pages * PAGE_SIZE) - self._told[0]   # the totals', no fraction of a page lost
        self._told = (self._told[0] + saved, self._told[1] + (cost or 0))
        return PinWorth(saved, cost, value.retention())

    def _check_deleted(self) -> bool:
        """Whether the image file was deleted from every path; reported when that changes."""
        try:
            deleted = self._inode is not None and os.fstat(self._inode).st_nlink == 0
        except OSError:
            deleted = False
        if deleted != self.status.image_deleted:
            self.status.image_deleted = deleted
            self._metrics.set_deleted(deleted)
            self._log.log(logging.WARNING if deleted else logging.INFO,
                          event("disk.image_deleted" if deleted else "disk.image_linked", disk=self.target,
                                image=self.image))
        return deleted

    @property
    def layer_of(self) -> str | None:
        """The target whose top image this one is a backing layer of; None for a top."""
        return self.status.layer_of

    def demote(self, *, qemu_alive: bool = True) -> None:
        """The image became a read-only backing layer (an external snapshot put an overlay on it).

        Its bitmap goes, its heat and pins stay: the worker goes on as a layer of the same target.
        """
        self._stop_tracker(qemu_alive)
        self.tracker = None
        self.engine.track(None)
        self._agent_metrics.remove_disk(self.target, self.image)
        self._metrics = self._agent_metrics.disk(self.target, self.image, layer=True)
        self.status.layer_of = self.target
        self.status.dirty_granule_bytes = None
        self._log.info(event("disk.demoted", disk=self.target, image=self.image))

    def take_over(self, layer: DiskWorker) -> None:
        """Carry on ``layer``'s heat and pins: its file is this disk's top now (a commit's pivot onto it).

        ``layer`` gets this worker's fresh engine in exchange; closing it then unpins nothing of ours.
        """
        fresh, self.engine = self.engine, layer.engine
        layer.engine = fresh
        self.engine.track(self._writes if self.tracker else None)
        self.engine.count_reads(self._read_source())
        layer.engine.count_reads(layer._read_source())
        self.engine.budget = self.budget
        self._log.info(event("disk.promoted", disk=self.target, image=self.image))

    @property
    def pinned_bytes(self) -> int:
        """Bytes pinned after the last cycle (0 before the first)."""
        return self.engine.last.pinned_bytes if self.engine.last else 0

    def demand(self, share: float) -> Curve:
        """The disk's demand curve at its budget times ``share`` (empty before its first cycle)."""
        return self.engine.demand(int(self.budget * share))

    def rebind(self, monitor: Monitor) -> None:
        """Talk to QEMU through ``monitor`` from now on (libvirtd reconnected)."""
        if self.tracker is not None:
            self.tracker.monitor = monitor

    def heatmap_data(self, title: str) -> HeatmapData | None:
        """The heat map as of the last cycle; None before the first scan."""
        if self.engine.residency is None:
            return None
        return self.engine.heatmap_data(self.target, title=title)

    def write_heatmap(self, title: str) -> None:
        """Count a cycle for the heat-map files; write them when due (a failure is logged)."""
        if self._heatmap is None:
            return
        try:
            self._heatmap.cycle(lambda: self.engine.heatmap_data(self.target, title=title))
        except VmcacheError as err:
            self._log.warning(event("heatmap.failed", disk=self.target, error=err))

    def close(self, *, qemu_alive: bool = True) -> None:
        """Unpin everything; remove our bitmaps and exports while QEMU is there to ask.

        With QEMU gone (``qemu_alive`` False) its bitmaps went with it: only
        our local socket directory is cleaned up.
        """
        try:
            self._stop_tracker(qemu_alive)
        finally:
            self._close_reads()
            self.engine.close()
            self._agent_metrics.remove_disk(self.target, self.image, layer=self.layer_of is not None)
            if self._inode is not None:
                os.close(self._inode)
                self._inode = None

    def _close_reads(self) -> None:
        reads, self._file_reads = self._file_reads, None
        if reads is not None:
            reads.close()

    def _stop_tracker(self, qemu_alive: bool) -> None:
        if self.tracker is not None:
            try:
                self.tracker.stop()
            except VmcacheError as err:
                level = logging.WARNING if qemu_alive else logging.DEBUG
                self._log.log(level, event("tracker.stop_failed", disk=self.target, error=err))


def _open_inode(path: str) -> int | None:
    """An O_PATH descriptor of ``path`` (its link count says whether any path still names it); None if it cannot."""
    try:
        return os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return None
