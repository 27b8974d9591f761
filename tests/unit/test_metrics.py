"""AgentMetrics / DiskMetrics: what an operator sees in the exposition text."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client import CollectorRegistry, enable_created_metrics, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from vmcache.model.pinvalue import PinWorth
from vmcache.errors import BitmapReadError, MonitorConnectionError, PinError, VmcacheError
from vmcache.observe.metrics import BITMAP_RESULTS, ERROR_KINDS, AgentMetrics, error_kind
from vmcache.model.stats import CycleStats
from vmcache.model.extents import BitmapRead

UUID = "6a1f0c3e-2b4d-4e8f-9a0b-1c2d3e4f5a6b"
DISK = {"domain": "web1", "uuid": UUID, "target_device": "vda", "source_file": "/var/lib/libvirt/images/web1.qcow2"}

MiB = 1 << 20


def cycle(**changes: object) -> CycleStats:
    base = CycleStats(
        now=100.0,
        duration_seconds=0.03,
        size_bytes=2048 * MiB,
        budget_bytes=256 * MiB,
        pinned_bytes=192 * MiB,
        pinned_regions=7,
        resident_bytes=300 * MiB,
        guest_written_bytes=4 * MiB,
        guest_read_miss_bytes=9 * MiB,
        recently_evicted_pages=1234,
        bitmap_read=BitmapRead.OK,
        mem_available_bytes=12 * 1024 * MiB,
        backing_off=False,
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def samples(registry: CollectorRegistry) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of the exposition text, parsed back as Prometheus would."""
    text = generate_latest(registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return samples(registry).get((name, frozenset(labels.items())))


def types(registry: CollectorRegistry) -> dict[str, str]:
    text = generate_latest(registry).decode()
    return {f.name: f.type for f in text_string_to_metric_families(text)}


@pytest.fixture
def agent() -> AgentMetrics:
    return AgentMetrics("web1", UUID, registry=CollectorRegistry(), version="9.8.7")


def test_levels_of_one_cycle_are_exported_with_disk_labels(agent: AgentMetrics) -> None:
    agent.disk("vda", DISK["source_file"]).observe(cycle())
    reg = agent.registry
    assert value(reg, "vmcache_budget_bytes", **DISK) == 256 * MiB
    assert value(reg, "vmcache_pinned_bytes", **DISK) == 192 * MiB
    assert value(reg, "vmcache_pinned_regions", **DISK) == 7
    assert value(reg, "vmcache_resident_bytes", **DISK) == 300 * MiB
    assert value(reg, "vmcache_image_size_bytes", **DISK) == 2048 * MiB
    assert value(reg, "vmcache_recently_evicted_pages", **DISK) == 1234
    assert value(reg, "vmcache_backing_off", **DISK) == 0
    assert value(reg, "vmcache_host_memory_available_bytes", domain="web1", uuid=UUID) == 12 * 1024 * MiB


def test_metric_types_follow_prometheus_conventions(agent: AgentMetrics) -> None:
    agent.disk("vda", DISK["source_file"]).observe(cycle())
    t = types(agent.registry)
    # The parser strips _total from counter family names and _info from info.
    assert t["vmcache_guest_dirtied_bytes"] == "counter"
    assert t["vmcache_guest_read_miss_bytes"] == "counter"
    assert t["vmcache_bitmap_reads"] == "counter"
    assert t["vmcache_errors"] == "counter"
    assert t["vmcache_cycle_duration_seconds"] == "histogram"
    assert t["vmcache_pinned_bytes"] == "gauge"
    names = {name for name, _ in samples(agent.registry)}
    assert {"vmcache_guest_dirtied_bytes_total", "vmcache_guest_read_miss_bytes_total",
            "vmcache_bitmap_reads_total", "vmcache_errors_total", "vmcache_agent_info"} <= names
    assert all(n.startswith("vmcache_") for n in names)


def test_guest_counters_accumulate_across_cycles_while_levels_are_replaced(agent: AgentMetrics) -> None:
    disk = agent.disk("vda", DISK["source_file"])
    disk.observe(cycle(guest_written_bytes=4 * MiB, guest_read_miss_bytes=1 * MiB, pinned_bytes=10 * MiB))
    disk.observe(cycle(guest_written_bytes=6 * MiB, guest_read_miss_bytes=0, pinned_bytes=3 * MiB))
    reg = agent.registry
    assert value(reg, "vmcache_guest_dirtied_bytes_total", **DISK) == 10 * MiB
    assert value(reg, "vmcache_guest_read_miss_bytes_total", **DISK) == 1 * MiB
    assert value(reg, "vmcache_pinned_bytes", **DISK) == 3 * MiB


def test_cycle_durations_land_in_histogram_buckets(agent: AgentMetrics) -> None:
    disk = agent.disk("vda", DISK["source_file"])
    for d in (0.003, 0.04, 0.04, 3.0):
        disk.observe(cycle(duration_seconds=d))
    reg = agent.registry
    assert value(reg, "vmcache_cycle_duration_seconds_count", **DISK) == 4
    assert value(reg, "vmcache_cycle_duration_seconds_sum", **DISK) == pytest.approx(3.083)
    assert value(reg, "vmcache_cycle_duration_seconds_bucket", le="0.005", **DISK) == 1
    assert value(reg, "vmcache_cycle_duration_seconds_bucket", le="0.05", **DISK) == 3
    assert value(reg, "vmcache_cycle_duration_seconds_bucket", le="2.5", **DISK) == 3
    assert value(reg, "vmcache_cycle_duration_seconds_bucket", le="+Inf", **DISK) == 4


def test_bitmap_reads_are_counted_by_result_and_none_is_not_a_read(agent: AgentMetrics) -> None:
    disk = agent.disk("vda", DISK["source_file"])
    for result in ("ok", "ok", "failed", "deferred", "none", "ok"):
        disk.observe(cycle(bitmap_read=result))
    reg = agent.registry
    got = {r: value(reg, "vmcache_bitmap_reads_total", result=r, **DISK) for r in BITMAP_RESULTS}
    assert got == {"ok": 3, "deferred": 1, "failed": 1}
    assert value(reg, "vmcache_bitmap_reads_total", result="none", **DISK) is None


def test_a_new_disk_shows_zero_series_before_its_first_cycle(agent: AgentMetrics) -> None:
    agent.disk("vda", DISK["source_file"])
    reg = agent.registry
    assert value(reg, "vmcache_bitmap_reads_total", result="failed", **DISK) == 0
    assert value(reg, "vmcache_guest_dirtied_bytes_total", **DISK) == 0
    assert value(reg, "vmcache_pinned_bytes", **DISK) == 0


def test_bad_cycle_record_raises_and_changes_nothing(agent: AgentMetrics) -> None:
    disk = agent.disk("vda", DISK["source_file"])
    disk.observe(cycle(pinned_bytes=5))
    before = samples(agent.registry)
    for bad in (cycle(guest_written_bytes=-1, pinned_bytes=6), cycle(bitmap_read="maybe", pinned_bytes=6),
                cycle(duration_seconds=-0.1, pinned_bytes=6)):
        with pytest.raises(ValueError):
            disk.observe(bad)
    assert samples(agent.registry) == before


def test_without_cachestat_there_is_no_evicted_series_rather_than_a_false_zero(agent: AgentMetrics) -> None:
    disk = agent.disk("vda", DISK["source_file"])
    disk.observe(cycle(recently_evicted_pages=None))
    assert value(agent.registry, "vmcache_recently_evicted_pages", **DISK) is None
    disk.observe(cycle(recently_evicted_pages=5))
    assert value(agent.registry, "vmcache_recently_evicted_pages", **DISK) == 5
    disk.observe(cycle(recently_evicted_pages=None))
    assert value(agent.registry, "vmcache_recently_evicted_pages", **DISK) is None


def test_backing_off_is_one_and_reports_skipped_bytes(agent: AgentMetrics) -> None:
    agent.disk("vda", DISK["source_file"]).observe(cycle(backing_off=True, skipped_for_floor_bytes=64 * MiB))
    assert value(agent.registry, "vmcache_backing_off", **DISK) == 1
    assert value(agent.registry, "vmcache_backoff_skipped_bytes", **DISK) == 64 * MiB


def test_agent_info_carries_version_identity_and_the_read_signal(agent: AgentMetrics) -> None:
    info = {"domain": "web1", "uuid": UUID, "version": "9.8.7"}
    assert value(agent.registry, "vmcache_agent_info", read_signal="inferred", **info) == 1
    agent.set_read_signal("probe")
    assert value(agent.registry, "vmcache_agent_info", read_signal="probe", **info) == 1
    assert value(agent.registry, "vmcache_agent_info", read_signal="inferred", **info) is None


def test_counted_reads_appear_with_the_first_count_and_go_with_the_disk(agent: AgentMetrics) -> None:
    disk = agent.disk("vda", DISK["source_file"])
    assert value(agent.registry, "vmcache_guest_read_bytes_total", **DISK) is None  # inferred: no series
    disk.observe_reads(40 * MiB, 36 * MiB, 0)
    disk.observe_reads(4 * MiB, 4 * MiB, 3)
    assert value(agent.registry, "vmcache_guest_read_bytes_total", **DISK) == 44 * MiB
    assert value(agent.registry, "vmcache_guest_read_hit_bytes_total", **DISK) == 40 * MiB
    assert value(agent.registry, "vmcache_guest_read_dropped_blocks_total", **DISK) == 3
    with pytest.raises(ValueError):
        disk.observe_reads(MiB, 2 * MiB, 0)  # more hits than reads
    agent.remove_disk("vda")
    assert value(agent.registry, "vmcache_guest_read_bytes_total", **DISK) is None


def test_what_the_pins_saved_adds_up_and_the_kernels_retention_follows_the_last_judgement(agent: AgentMetrics) -> None:
    disk = agent.disk("vda", DISK["source_file"])
    disk.observe_reads(40 * MiB, 36 * MiB, 0, PinWorth(8 * MiB, 2 * MiB, 64.0))
    disk.observe_reads(4 * MiB, 4 * MiB, 0, PinWorth(MiB, None, float("inf")))   # no limit's figures: no cost
    assert value(agent.registry, "vmcache_pin_saved_bytes_total", **DISK) == 9 * MiB
    assert value(agent.registry, "vmcache_pin_cost_bytes_total", **DISK) == 2 * MiB
    assert value(agent.registry, "vmcache_kernel_retention_seconds", **DISK) == float("inf")
    disk.observe_reads(4 * MiB, 4 * MiB, 0, PinWorth(0, 0, None))   # too few re-reads now
    assert value(agent.registry, "vmcache_kernel_retention_seconds", **DISK) is None
    with pytest.raises(ValueError):
        PinWorth(-1, None, None)
    agent.remove_disk("vda")
    assert value(agent.registry, "vmcache_pin_saved_bytes_total", **DISK) is None


def test_errors_are_counted_by_bounded_kind(agent: AgentMetrics) -> None:
    agent.count_error(BitmapReadError("nbd gone"))
    agent.count_error(PinError)
    agent.count_error("pin")
    agent.disk("vda", DISK["source_file"]).count_error(MonitorConnectionError("lost"))
    agent.count_error(KeyError("not ours"))
    agent.count_error("something-new-and-unbounded")
    reg = agent.registry
    ident = {"domain": "web1", "uuid": UUID}
    assert value(reg, "vmcache_errors_total", kind="bitmap_read", **ident) == 1
    assert value(reg, "vmcache_errors_total", kind="pin", **ident) == 2
    assert value(reg, "vmcache_errors_total", kind="monitor_connection", **ident) == 1
    assert value(reg, "vmcache_errors_total", kind="other", **ident) == 2
    assert value(reg, "vmcache_errors_total", kind="host", **ident) == 0
    kinds = {dict(labels)["kind"] for name, labels in samples(reg) if name == "vmcache_errors_total"}
    assert kinds == ERROR_KINDS


def test_error_kind_maps_subclasses_to_nearest_known_class() -> None:
    class CustomPinError(PinError):
        pass

    assert error_kind(CustomPinError("x")) == "pin"
    assert error_kind(VmcacheError("x")) == "vmcache"
    assert error_kind(OSError(5, "EIO")) == "other"


def test_two_disks_are_separate_series_and_removal_drops_only_one(agent: AgentMetrics) -> None:
    agent.disk("vda", "/img/a.raw").observe(cycle(pinned_bytes=1 * MiB))
    agent.disk("vdb", "/img/b.raw").observe(cycle(pinned_bytes=2 * MiB))
    agent.remove_disk("vda")
    agent.remove_disk("vdz")  # unknown: ignored
    left = {dict(labels).get("target_device") for name, labels in samples(agent.registry) if name.startswith("vmcache_")}
    assert left == {"vdb", None}  # None: the agent-level series
    assert value(agent.registry, "vmcache_pinned_bytes", domain="web1", uuid=UUID,
                 target_device="vdb", source_file="/img/b.raw") == 2 * MiB
    assert set(agent.disks) == {"vdb"}


def test_same_disk_twice_is_the_same_object_and_a_new_image_replaces_the_series(agent: AgentMetrics) -> None:
    first = agent.disk("vda", "/img/old.raw")
    assert agent.disk("vda", "/img/old.raw") is first
    first.observe(cycle())
    agent.disk("vda", "/img/new.raw")
    images = {dict(labels).get("source_file") for name, labels in samples(agent.registry)
              if name == "vmcache_pinned_bytes"}
    assert images == {"/img/new.raw"}


def test_label_values_with_quotes_and_unicode_survive_exposition() -> None:
    agent = AgentMetrics('we"b\\1 ü', UUID, registry=CollectorRegistry())
    agent.disk("sda", "/img/with space/\"q\".raw").observe(cycle())
    assert value(agent.registry, "vmcache_pinned_bytes", domain='we"b\\1 ü', uuid=UUID,
                 target_device="sda", source_file="/img/with space/\"q\".raw") == 192 * MiB


def test_default_registry_is_private_and_carries_process_metrics() -> None:
    try:
        a = AgentMetrics("one", UUID)
        b = AgentMetrics("two", UUID)  # no duplicate-registration error: separate registries
        a.disk("vda", "/img").observe(cycle())
        names = {name for name, _ in samples(a.registry)}
    finally:
        enable_created_metrics()  # the production default turned them off process-wide
    assert a.registry is not b.registry
    assert "process_resident_memory_bytes" in names
    assert not any(n.startswith("vmcache_") and n.endswith("_created") for n in names)


def test_share_of_the_host_cap_per_domain(agent: AgentMetrics) -> None:
    reg = agent.registry
    agent.set_share(budget=2048 * MiB, granted=512 * MiB, demand=600 * MiB, minimum=64 * MiB,
                    cap=1024 * MiB)
    labels = {"domain": "web1", "uuid": UUID}
    assert value(reg, "vmcache_granted_bytes", **labels) == 512 * MiB
    assert value(reg, "vmcache_demand_bytes", **labels) == 600 * MiB
    assert value(reg, "vmcache_guaranteed_bytes", **labels) == 64 * MiB
    assert value(reg, "vmcache_domain_budget_bytes", **labels) == 2048 * MiB
    assert value(reg, "vmcache_host_pinned_cap_bytes", **labels) == 1024 * MiB
    agent.set_share(budget=1, granted=1, demand=0, minimum=0, cap=None)  # no cap: no series, not a false 0
    assert value(reg, "vmcache_host_pinned_cap_bytes", **labels) is None


def test_the_bytes_charged_to_the_agent_are_exported_where_the_engine_reports_them(agent: AgentMetrics) -> None:
    disk = agent.disk("vda", DISK["source_file"])
    disk.observe(cycle())
    assert value(agent.registry, "vmcache_agent_charged_bytes", **DISK) == 0  # a fresh disk's series, not reported
    disk.observe(cycle(agent_charged_bytes=128 * MiB))  # QEMU under a limit the agent is not
    assert value(agent.registry, "vmcache_agent_charged_bytes", **DISK) == 128 * MiB
    disk.observe(cycle(agent_charged_bytes=0))  # no pin read in by the agent
    assert value(agent.registry, "vmcache_agent_charged_bytes", **DISK) == 0


def test_locked_bytes_are_exported_where_the_engine_reports_them(agent: AgentMetrics) -> None:
    disk = agent.disk("vda", DISK["source_file"])
    disk.observe(cycle(locked_bytes=40 * MiB))  # fill: cached: a 192 MiB pin holds what the guest read
    assert value(agent.registry, "vmcache_pinned_bytes", **DISK) == 192 * MiB
    assert value(agent.registry, "vmcache_locked_bytes", **DISK) == 40 * MiB
    disk.observe(cycle(locked_bytes=None))  # not reported: the last figure stays, never a false 0
    assert value(agent.registry, "vmcache_locked_bytes", **DISK) == 40 * MiB
