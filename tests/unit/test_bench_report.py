"""The end-to-end bench's arithmetic: figures over measured runs, per-round ratios, verdicts."""

from bench.e2e_arms import GOALS, every_arm
from bench.e2e_host import DEVICES
from bench.e2e_report import Spread, device_check_line, figures, goal_table, miss_figures, paired_ratios, verdict


def job(read_ios: int, write_ios: int, runtime_ms: int = 10_000, lat_us: float = 100.0) -> dict:
    side = lambda ios: {"total_ios": ios, "runtime": runtime_ms, "iops": ios * 1000 / runtime_ms,  # noqa: E731
                        "lat_ns": {"mean": lat_us * 1000}, "clat_ns": {"percentile": {"99.000000": 2 * lat_us * 1000}}}
    return {"read": side(read_ios), "write": side(write_ios)}


def row(arm: str, round_: int, iops: float, ok: bool = True) -> dict:
    return {"arm": arm, "round": round_, "ok": ok, "figures": {"iops": iops}}


def test_figures_pool_several_measured_runs_by_ios_and_time():
    f = figures([job(8000, 2000), job(4000, 1000)])   # two 10 s phases
    assert f["read_iops"] == 600 and f["write_iops"] == 150 and f["iops"] == 750
    assert f["read_lat_mean_us"] == 100 and f["read_lat_p99_us"] == 200


def test_ratios_are_taken_within_each_round_and_skip_failed_runs():
    runs = [row("a-vmcache", 1, 300), row("a-kernel", 1, 200), row("a-vmcache", 2, 330), row("a-kernel", 2, 300),
            row("a-vmcache", 3, 999), row("a-kernel", 3, 100, ok=False)]
    assert paired_ratios(runs, "a-vmcache", "a-kernel") == [1.5, 1.1]


def test_a_spread_across_one_is_no_difference():
    assert verdict(Spread.of([0.9, 1.2, 1.6]), 1.3) == "missed (no difference)"
    assert verdict(Spread.of([1.4, 1.6, 1.7]), 1.5) == "met"
    assert verdict(Spread.of([1.2, 1.3, 1.35]), 1.5) == "missed"
    assert verdict(Spread.of([0.95, 0.99, 1.02]), 0.97) == "met (no difference)"
    assert verdict(Spread.of([0.95, 1.01]), None) == "no difference"
    assert verdict(None, 1.3) == "not run"


def test_every_goal_names_arms_the_bench_can_run():
    arms = every_arm()
    for goal in GOALS:
        assert goal.arm in arms and goal.reference in arms
    table = goal_table(GOALS, [row("reuse-ssd-vmcache", 1, 3), row("reuse-ssd-kernel", 1, 2)])
    assert "| 1.50 (1.50-1.50) | 1 | >= 1.5 | met | -, - |" in table


def test_time_to_steady_from_the_guests_request_counts():
    from bench.e2e_report import boot_table, time_to_steady

    # 10 s at 100 IOPS, then 1000 IOPS: the 5 s average reaches 900 five seconds after the change
    counts, ios = [], 0
    for t in range(30):
        counts.append({"t": float(t + 3), "measuring": True, "ios": ios})
        ios += 100 if t < 10 else 1000
    samples = [{"t": 1.0, "measuring": False, "ios": 0}, {"t": 2.0, "measuring": False, "ios": 0}, *counts]
    assert time_to_steady(samples, 1000.0) == 15.0  # from the first measuring sample (t=3) to t=18
    after = [*samples[:12], *({**r, "measuring": False} for r in samples[12:])]  # the steady run after
    assert time_to_steady(after, 1000.0) == 15.0
    assert time_to_steady(samples, 5000.0) is None
    assert time_to_steady([{"t": 1.0, "measuring": True, "ios": None}] * 9, 10.0) is None
    runs = [{"arm": "coldboot-hdd-warm", "ok": True, "figures": {"iops": 800.0, "steady_iops": 1000.0,
                                                                "t90_seconds": 15.0}}]
    assert "| coldboot-hdd-warm | 1 | 800 (800-800) | 1000 (1000-1000) | 15.0 (15.0-15.0) |" in boot_table(
        ["coldboot-hdd-warm", "coldboot-hdd-evicted"], runs)


def test_misses_per_guest_read_from_the_delay_devices_counters():
    f = miss_figures({"device": 4096 * 300, "device_requests": 150}, guest_reads=1000, guest_writes=500)
    assert f == {"device_reads_per_guest_read": 0.3, "device_requests_per_guest_read": 0.15,
                 "device_reads_per_guest_io": 0.2}


def test_misses_per_guest_read_on_the_real_disk_split_qemu_and_agent():
    f = miss_figures({"qemu": 4096 * 500, "agent": 4096 * 100}, guest_reads=1000)
    assert f == {"qemu_device_reads_per_guest_read": 0.5, "agent_device_reads_per_guest_read": 0.1,
                 "device_reads_per_guest_read": 0.6, "device_reads_per_guest_io": 0.6}
    assert miss_figures({}, 1000) == {} and miss_figures({"device": 4096}, 0) == {}


def test_a_ratio_to_the_best_peer_takes_the_best_reference_of_each_round():
    from bench.e2e_report import best_of

    runs = [row("a-vmcache", 1, 300), row("a-kernel", 1, 200), row("a-partition", 1, 250),
            row("a-vmcache", 2, 300), row("a-kernel", 2, 310), row("a-partition", 2, 150),
            row("a-vmcache", 3, 300), row("a-kernel", 3, 100)]   # round 3: no partition, no best peer
    assert paired_ratios(runs, "a-vmcache", "a-kernel", "a-partition") == [1.2, 300 / 310]
    assert best_of(runs, ("a-kernel", "a-partition")) == {1: "a-partition", 2: "a-kernel"}


def test_the_goal_table_names_the_best_peer_and_the_device_reads_beside_the_ratio():
    def run(arm, rnd, iops, per_io):
        return {**row(arm, rnd, iops), "figures": {"iops": iops, "device_reads_per_guest_io": per_io}}

    goal = next(g for g in GOALS if g.arm == "sibreuse-ssd-vmcache")
    assert goal.references == ("sibreuse-ssd-kernel", "sibreuse-ssd-partition")
    runs = [run("sibreuse-ssd-vmcache", 1, 200, 0.3), run("sibreuse-ssd-kernel", 1, 100, 0.8),
            run("sibreuse-ssd-partition", 1, 160, 0.4)]
    table = goal_table([goal], runs)
    assert "best of sibreuse-ssd-kernel, sibreuse-ssd-partition (r1: partition)" in table
    assert "| 1.25 (1.25-1.25) | 1 | >= 0.97 | met | 0.30 (0.30-0.30), 0.60 (0.40-0.80) |" in table


def test_device_check_line_names_every_case():
    case = lambda us: {"iops": 1000, "lat_mean_us": us, "lat_p50_us": us, "lat_p99_us": 2 * us}  # noqa: E731
    line = device_check_line("ssd", {"miss": case(430.0), "miss_32": case(900.0), "hit": case(0.7),
                                     "sync_write": case(500.0)})
    assert line.startswith("ssd: ")
    for text in ("miss 430.0 us (p50 430.0, p99 860.0)", "32 parallel misses 1000 IOPS", "hit 0.7 us",
                 "O_SYNC write 500.0 us"):
        assert text in line


def test_only_the_none_device_is_the_real_disk():
    assert not DEVICES["none"].delayed and "real disk" in DEVICES["none"].describe()
    assert DEVICES["ssd"].delayed and DEVICES["hdd"].delayed
    assert DEVICES["ssd"].read_ms < 0.5 < 3 < DEVICES["hdd"].read_ms <= 8


def test_device_reads_are_told_apart_by_pin_loads_request_size_and_range():
    from bench.device_reads import PinAdd, classify, pin_adds

    log = ("2026-11-26 10:56:19,560 INFO vmcache.service.agent.d pin.add start=1048576 length=4194304 priority=5\n"
           "2026-11-26 10:56:19,561 INFO vmcache.service.agent.d pin.apply regions=1\n")
    (pin,) = pin_adds(log)
    assert (pin.start, pin.length) == (1 << 20, 4 << 20)
    pins = [PinAdd(100.0, 1 << 20, 4 << 20)]
    reads = [(98.0, 2 << 20, 65536),     # in the region, just before its pin.add: the agent's load (16 pages)
             (90.0, 2 << 20, 65536),     # the same range long before: readahead, "other"
             (99.0, 4096, 4096),         # a single page in the hot range
             (99.5, 900 << 20, 4096),    # a single page beyond it
             (150.0, 0, 4096)]           # after the window
    assert classify(reads, pins, (80.0, 120.0), hot_end=100 << 20) == {
        "agent load": 16, "guest 4k hot": 1, "guest 4k cold": 1, "other": 16}
