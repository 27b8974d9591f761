"""The Prometheus series of one disk of an agent (vmcache.observe.metrics makes them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram

from ..model.extents import BitmapRead
from ..model.pinvalue import PinWorth
from ..model.stats import CycleStats

if TYPE_CHECKING:
    from .metrics import AgentMetrics

__all__ = ["DiskMetrics", "BITMAP_RESULTS", "discard"]

#: Values of CycleStats.bitmap_read counted by vmcache_bitmap_reads_total
#: (NONE, a disk without a tracker, is not a read and is not counted).
BITMAP_RESULTS = tuple(r.value for r in BitmapRead if r is not BitmapRead.NONE)


class DiskMetrics:
    """The series of one disk of an agent; made by :meth:`AgentMetrics.disk`."""

    def __init__(self, agent: AgentMetrics, target: str, image: str) -> None:
        self.agent = agent
        self.target = target
        self.image = image
        self._labels = (*agent._agent, target, image)
        a = agent
        self._gauges = (a.image_size, a.budget, a.pinned, a.locked, a.agent_charged, a.pinned_regions, a.resident,
                        a.backing_off, a.backoff_skipped, a.warm_restored, a.warm_total, a.image_deleted)
        self._counters = (a.guest_written, a.guest_read_miss, a.cycle_duration)
        # Create the series now so a fresh disk shows zeros, not nothing.
        for metric in (*self._gauges, *self._counters):
            metric.labels(*self._labels)
        for result in BITMAP_RESULTS:
            a.bitmap_reads.labels(*self._labels, result)

    def observe_reads(self, read_bytes: int, hit_bytes: int, dropped_blocks: int, worth: PinWorth | None = None
                      ) -> None:
        """Add one cycle's counted reads (the series appear with the first), and what the pins were worth in it
        (None: not judged). Raises ValueError when negative."""
        if min(read_bytes, hit_bytes, dropped_blocks) < 0 or hit_bytes > read_bytes:
            raise ValueError(f"bad read figures {read_bytes}, {hit_bytes}, {dropped_blocks}")
        a, labels = self.agent, self._labels
        a.guest_read.labels(*labels).inc(read_bytes)
        a.guest_read_hit.labels(*labels).inc(hit_bytes)
        a.guest_read_dropped.labels(*labels).inc(dropped_blocks)
        if worth is None:
            return
        a.pin_saved.labels(*labels).inc(worth.saved_bytes)
        if worth.cost_bytes is not None:
            a.pin_cost.labels(*labels).inc(worth.cost_bytes)
        if worth.retention is None:
            discard(a.kernel_retention, labels)
        else:
            a.kernel_retention.labels(*labels).set(worth.retention)

    def set_deleted(self, deleted: bool) -> None:
        """Record whether the image file was deleted (no path names it)."""
        self.agent.image_deleted.labels(*self._labels).set(1 if deleted else 0)

    def observe(self, stats: CycleStats) -> None:
        """Update every series of this disk from one cycle's record.

        Levels are set, ``guest_*`` figures added to their counters, the
        bitmap read counted by its result and the duration observed.
        Raises ValueError, before changing anything, when a ``guest_*``
        figure or the duration is negative or ``bitmap_read`` is unknown.
        """
        if stats.guest_written_bytes < 0 or stats.guest_read_miss_bytes < 0:
            raise ValueError(f"negative guest figure in {stats!r}")
        if stats.duration_seconds < 0:
            raise ValueError(f"negative cycle duration in {stats!r}")
        bitmap_read = BitmapRead(stats.bitmap_read)  # ValueError when unknown
        a, labels = self.agent, self._labels
        a.image_size.labels(*labels).set(stats.size_bytes)
        a.budget.labels(*labels).set(stats.budget_bytes)
        a.pinned.labels(*labels).set(stats.pinned_bytes)
        if stats.locked_bytes is not None:
            a.locked.labels(*labels).set(stats.locked_bytes)
        if stats.agent_charged_bytes is not None:
            a.agent_charged.labels(*labels).set(stats.agent_charged_bytes)
        a.pinned_regions.labels(*labels).set(stats.pinned_regions)
        a.resident.labels(*labels).set(stats.resident_bytes)
        a.backing_off.labels(*labels).set(1 if stats.backing_off else 0)
        a.backoff_skipped.labels(*labels).set(stats.skipped_for_floor_bytes)
        a.warm_restored.labels(*labels).set(stats.warm_restored_bytes)
        a.warm_total.labels(*labels).set(stats.warm_total_bytes)
        if stats.recently_evicted_pages is None:
            # No cachestat on this kernel: no series rather than a false 0.
            discard(a.recently_evicted, labels)
        else:
            a.recently_evicted.labels(*labels).set(stats.recently_evicted_pages)
        a.guest_written.labels(*labels).inc(stats.guest_written_bytes)
        a.guest_read_miss.labels(*labels).inc(stats.guest_read_miss_bytes)
        if bitmap_read is not BitmapRead.NONE:
            a.bitmap_reads.labels(*labels, bitmap_read.value).inc()
        a.cycle_duration.labels(*labels).observe(stats.duration_seconds)
        a.set_host_memory(stats.mem_available_bytes)

    def count_error(self, kind: BaseException | type[BaseException] | str) -> None:
        """Count one error of this disk's agent (errors are counted per agent, by kind)."""
        self.agent.count_error(kind)

    def _remove(self) -> None:
        a, labels = self.agent, self._labels
        for metric in (*self._gauges, *self._counters, a.recently_evicted, a.guest_read, a.guest_read_hit,
                       a.guest_read_dropped, a.pin_saved, a.pin_cost, a.kernel_retention):
            discard(metric, labels)
        for result in BITMAP_RESULTS:
            discard(a.bitmap_reads, (*labels, result))


def discard(metric: Gauge | Counter | Histogram, labels: tuple[str, ...]) -> None:
    # prometheus_client before 0.20 raises KeyError for a series that is not there.
    try:
        metric.remove(*labels)
    except KeyError:
        pass
