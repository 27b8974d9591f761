"""Prometheus collectors of one agent: what it pins, what the guest does, how it fares.

One :class:`AgentMetrics` per agent (per domain) holds a registry; each disk
the agent manages gets a :class:`DiskMetrics` from :meth:`AgentMetrics.disk`
and is fed one :class:`~vmcache.model.stats.CycleStats` per cycle. Serving the
registry over HTTP is :mod:`vmcache.observe.exporter`'s job.

Labels are bounded: ``domain`` and ``uuid`` (one value per agent),
``target_device`` (the target, e.g. ``vda``) and ``source_file`` (its image
file) per managed disk - the names the libvirt exporters use, so PromQL
joins their series with vmcache's - and
the fixed sets ``result`` (bitmap reads) and ``kind`` (errors). A disk that
goes away is dropped with :meth:`AgentMetrics.remove_disk` so its series go
with it. docs/metrics.md describes every metric.
"""

from __future__ import annotations

import re
import threading

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)

from .. import __version__, errors
from .diskmetrics import BITMAP_RESULTS, DiskMetrics, discard as _discard

__all__ = [
    "AgentMetrics",
    "DiskMetrics",
    "BITMAP_RESULTS",
    "ERROR_KINDS",
    "CYCLE_BUCKETS",
    "error_kind",
]

NAMESPACE = "vmcache"
AGENT_LABELS = ("domain", "uuid")
DISK_LABELS = ("domain", "uuid", "target_device", "source_file")

#: Cycle durations run from milliseconds (cachestat, small bitmaps) to
#: seconds (mincore over a large populated range, NBD round trips).
CYCLE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _snake(name: str) -> str:
    name = name.removesuffix("Error") or name
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


# One kind per class of vmcache's error tree (VmcacheError itself is "vmcache"),
# plus "other" for anything outside it: the label can never grow unbounded.
_KIND_OF_CLASS: dict[type[BaseException], str] = {
    getattr(errors, name): _snake(name) for name in errors.__all__
}
OTHER_KIND = "other"
#: Every value the ``kind`` label of vmcache_errors_total can take.
ERROR_KINDS = frozenset(_KIND_OF_CLASS.values()) | {OTHER_KIND}


def error_kind(error: BaseException | type[BaseException] | str) -> str:
    """The ``kind`` label for an error: an exception, its class, or a kind name.

    Exceptions map to their nearest class in vmcache's error tree
    (``BitmapReadError`` -> ``bitmap_read``, ``PinError`` -> ``pin``);
    anything else, and any unknown string, is ``other``.
    """
    if isinstance(error, str):
        return error if error in ERROR_KINDS else OTHER_KIND
    cls = error if isinstance(error, type) else type(error)
    for base in cls.__mro__:
        if base in _KIND_OF_CLASS:
            return _KIND_OF_CLASS[base]
    return OTHER_KIND


class AgentMetrics:
    """The metrics of one agent (one libvirt domain), in one registry.

    ``registry``: where the collectors are registered; by default a fresh
    :class:`CollectorRegistry` that also carries this process's
    ``process_*``, ``python_gc_*`` and ``python_info`` metrics (a process
    serves one agent, and nothing else shares the registry); that default
    also turns off prometheus_client's ``*_created`` series process-wide,
    which Prometheus's text format would store as extra gauges. Tests pass a
    fresh empty registry.
    """

    def __init__(
        self,
        domain: str,
        uuid: str,
        *,
        registry: CollectorRegistry | None = None,
        version: str = __version__,
    ) -> None:
        if registry is None:
            disable_created_metrics()  # type: ignore[no-untyped-call]  # prometheus_client leaves it unannotated
            registry = CollectorRegistry(auto_describe=True)
            ProcessCollector(registry=registry)
            PlatformCollector(registry=registry)
            GCCollector(registry=registry)
        self.registry = registry
        self.domain = domain
        self.uuid = uuid
        self._agent = (domain, uuid)
        self._lock = threading.Lock()
        self._disks: dict[str, DiskMetrics] = {}
        self._agent_series(version)
        self._disk_series()
        # Start every error kind at 0 so increase()/rate() see the first error.
        for kind in sorted(ERROR_KINDS):
            self.errors.labels(*self._agent, kind)

    def _gauge(self, name: str, doc: str, labels: tuple[str, ...] = DISK_LABELS) -> Gauge:
        return Gauge(name, doc, labels, namespace=NAMESPACE, registry=self.registry)

    def _counter(self, name: str, doc: str, labels: tuple[str, ...] = DISK_LABELS) -> Counter:
        return Counter(name, doc, labels, namespace=NAMESPACE, registry=self.registry)

    def _agent_series(self, version: str) -> None:
        """The series of the agent (the domain): its version, budget, share of the cap, host memory, errors."""
        gauge, counter, registry = self._gauge, self._counter, self.registry
        self.info = Info("agent", "The vmcache agent of a domain; value 1, its version and the signal of the "
                         "guest's reads it uses (read_signal: probe, tracepoint or inferred) as labels.",
                         AGENT_LABELS, namespace=NAMESPACE, registry=registry)
        self._version = version
        self.set_read_signal("inferred")
        self.host_memory_available = gauge(
            "host_memory_available_bytes",
            "MemAvailable of the host (/proc/meminfo) at the agent's last cycle.", AGENT_LABELS)
        self.domain_budget = gauge(
            "domain_budget_bytes", "The domain's budget in force (metadata budget, times the memory-pressure share).",
            AGENT_LABELS)
        self.granted = gauge(
            "granted_bytes", "The domain's grant: its share of the host's pinned cap in the split by benefit.",
            AGENT_LABELS)
        self.demand = gauge(
            "demand_bytes", "Bytes the domain's demand curve asks for (its plans at the full budget).", AGENT_LABELS)
        self.minimum = gauge("guaranteed_bytes", "The domain's guaranteed share of the cap (metadata min=).",
                             AGENT_LABELS)
        self.host_cap = gauge("host_pinned_cap_bytes", "The host-wide pinned_cap every agent shares (absent: no cap).",
                              AGENT_LABELS)
        self.errors = counter("errors", "Errors the agent met, by kind (a class of vmcache's error tree).",
                              (*AGENT_LABELS, "kind"))

    def _disk_series(self) -> None:
        """The series of each disk, labelled with its target device and image file."""
        gauge, counter, registry = self._gauge, self._counter, self.registry
        self.image_size = gauge("image_size_bytes", "Size of the disk's image file.")
        self.budget = gauge("budget_bytes", "Bytes of the image vmcache may pin (the budget in force).")
        self.pinned = gauge("pinned_bytes", "Bytes of the image vmcache pins (mapped and locked; the budget and "
                            "the host cap count them).")
        self.locked = gauge("locked_bytes", "Of the pinned bytes, those held in memory: all of them, or under "
                            "fill: cached the pages the guest has read into the pins.")
        self.agent_charged = gauge(
            "agent_charged_bytes", "Of the pinned bytes, those the agent read in itself, charged to its own memory "
            "cgroup: where QEMU is under a memory limit the agent is not.")
        self.pinned_regions = gauge("pinned_regions", "Number of contiguous regions vmcache has locked.")
        self.resident = gauge("resident_bytes", "Bytes of the image in the host page cache, pinned ones included.")
        self.recently_evicted = gauge(
            "recently_evicted_pages",
            "Pages of the image recently evicted from the page cache (cachestat nr_recently_evicted).")
        self.backing_off = gauge(
            "backing_off",
            "1 when the free-memory floor, a memory cgroup's limit or memory pressure kept vmcache from pinning "
            "what it planned.")
        self.backoff_skipped = gauge(
            "backoff_skipped_bytes",
            "Bytes planned for pinning but left unpinned because of the memory floor or a memory cgroup's limit.")
        self.warm_restored = gauge(
            "warm_restored_bytes", "Bytes of the saved hot set the disk started from that vmcache has pinned again "
            "(a region restored in chunks counts its pinned part).")
        self.warm_total = gauge(
            "warm_total_bytes", "Bytes of the saved hot set the disk started from (0: a cold start).")
        self.image_deleted = gauge(
            "image_deleted", "1 when no path names the disk's image file any more (deleted while in use).")
        self.guest_written = counter(
            "guest_dirtied_bytes",
            "Bytes of the image the guest dirtied: whole dirty-bitmap granules written into (64 KiB by default; "
            "a 4 KiB write counts its granule).")
        self.guest_read_miss = counter(
            "guest_read_miss_bytes",
            "Bytes of the image that entered the page cache not by vmcache's hand (guest reads or others).")
        self._read_series()
        self.bitmap_reads = counter("bitmap_reads", "Dirty-bitmap reads, by result (ok, deferred, failed).",
                                    (*DISK_LABELS, "result"))
        self.cycle_duration = Histogram(
            "cycle_duration_seconds", "Wall time of one agent cycle of a disk.", DISK_LABELS,
            namespace=NAMESPACE, registry=registry, buckets=CYCLE_BUCKETS)

    def _read_series(self) -> None:
        """The series of each disk's counted reads, and what its pins were worth in them."""
        gauge, counter = self._gauge, self._counter
        self.guest_read = counter(
            "guest_read_bytes",
            "Bytes of the image the guest read, cache hits included (each 4 KiB page of a read once), counted "
            "in the kernel. Absent where the agent infers reads (vmcache_agent_info read_signal).")
        self.guest_read_hit = counter(
            "guest_read_hit_bytes",
            "Of vmcache_guest_read_bytes, the bytes found in the page cache (not brought in for the read).")
        self.guest_read_dropped = counter(
            "guest_read_dropped_blocks",
            "Block counts the kernel could not keep because the disk's count map was full (65,536 blocks "
            "touched in one cycle); their reads are missing from vmcache_guest_read_bytes.")
        self.pin_saved = counter(
            "pin_saved_bytes",
            "Of the hits, the bytes read from vmcache's pins that the kernel alone would likely have missed: each "
            "pinned block's hits times the miss share of unpinned re-reads after as long a gap (an upper bound).")
        self.pin_cost = counter(
            "pin_cost_bytes",
            "What the disk's pins cost others: the bytes refaulted in QEMU's tightest limited memory cgroup (or the "
            "host) less the disk's own, times the pins' share of its page cache (an estimate beside "
            "vmcache_pin_saved_bytes_total).")
        self.kernel_retention = gauge(
            "kernel_retention_seconds",
            "How long the kernel keeps a page of the disk it is not asked to keep, as its counted reads show: "
            "the shortest gap after which most re-reads of unpinned blocks missed (+Inf: none did).")

    def disk(self, target: str, image: str, *, layer: bool = False) -> DiskMetrics:
        """The metrics of disk ``target`` (e.g. ``vda``) backed by ``image``.

        Asking again for the same target and image returns the same object;
        a new image at a known target (media change) drops the old series.
        ``layer``: ``image`` is a backing layer under ``target``'s top image
        (its series have the same labels, ``source_file`` naming the layer).
        """
        key = _key(target, image, layer)
        with self._lock:
            known = self._disks.get(key)
            if known is not None and known.image == image:
                return known
            if known is not None:
                known._remove()
            metrics = DiskMetrics(self, target, image)
            self._disks[key] = metrics
            return metrics

    def remove_disk(self, target: str, image: str | None = None, *, layer: bool = False) -> None:
        """Drop every series of disk ``target`` (hot-unplugged), or of its layer ``image``.

        With ``image``, only when the series are still that image's; unknown targets are ignored.
        """
        with self._lock:
            key = _key(target, image or "", layer)
            known = self._disks.get(key)
            if known is not None and image in (None, known.image):
                del self._disks[key]
                known._remove()

    @property
    def disks(self) -> dict[str, DiskMetrics]:
        """The disks with series now, by target."""
        with self._lock:
            return dict(self._disks)

    def count_error(self, kind: BaseException | type[BaseException] | str) -> None:
        """Count one error; ``kind`` is an exception, its class or a name from ERROR_KINDS."""
        self.errors.labels(*self._agent, error_kind(kind)).inc()

    def set_share(self, *, budget: int, granted: int, demand: int, minimum: int, cap: int | None) -> None:
        """Record the domain's part in the split of the host cap (docs/metrics.md)."""
        self.domain_budget.labels(*self._agent).set(budget)
        self.granted.labels(*self._agent).set(granted)
        self.demand.labels(*self._agent).set(demand)
        self.minimum.labels(*self._agent).set(minimum)
        if cap is None:
            _discard(self.host_cap, self._agent)
        else:
            self.host_cap.labels(*self._agent).set(cap)

    def set_read_signal(self, signal: str) -> None:
        """Record which signal of the guest's reads the agent uses: ``kernel`` (counted) or ``inferred``."""
        self.info.labels(*self._agent).info({"version": self._version, "read_signal": signal})

    def set_host_memory(self, available_bytes: int) -> None:
        """Record the host's MemAvailable."""
        self.host_memory_available.labels(*self._agent).set(available_bytes)


def _key(target: str, image: str, layer: bool) -> str:
    """The key of a disk's series: its target, or for a backing layer its target and file."""
    return f"{target}\0{image}" if layer else target
