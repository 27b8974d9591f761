"""The migration bench's arithmetic: windows after the switch, the warm reference, the agent's loads, the tables."""

from __future__ import annotations

import pytest

from bench.device_reads import Read, parse_reads
from bench.migrate_loads import Pin, loaded_bytes, parse_pins, value_of
from bench.migrate_report import GOALS, cpu_table, goal_table, iops_table, paired, partial_note, reads_table, set_table
from bench.migrate_windows import MIB, Timeline, at, clip, run_figures, span, window_figures


def test_a_counter_is_read_between_samples_by_linear_interpolation() -> None:
    series = [(0.0, 0.0), (1.0, 100.0), (3.0, 100.0), (4.0, 500.0)]
    assert at(series, 0.5) == 50 and at(series, 2.0) == 100 and at(series, 3.5) == 300 and at(series, 4.0) == 500
    with pytest.raises(ValueError):
        at(series, 4.5)
    s = span(series, 0.5, 3.5)
    assert s is not None and (s.delta, s.covered, s.length, s.whole) == (250, 3.0, 3.0, True)


def test_a_window_the_series_covers_in_part_is_measured_over_that_part_and_one_it_misses_not_at_all() -> None:
    series = [(0.0, 0.0), (5.0, 1000.0)]
    part = span(series, 4.0, 10.0)
    assert part is not None and part.covered == 1.0 and part.rate == 200 and not part.whole
    assert span(series, 5.0, 10.0) is None and span(series, 6.0, 9.0) is None and span([], 0, 1) is None
    assert clip(series, 1.0, 2.0) == [(1.0, 200.0), (2.0, 400.0)]


def timeline(**kw: float) -> Timeline:
    base = {"migrate_start": 1000.0, "migrate_end": 1003.0, "switch": 1002.5, "measure": 120.0}
    return Timeline(**{**base, **kw})


def samples(seconds: int = 150, iops_a: int = 900, iops_b: int = 100, reads_b: int = 80) -> list[dict]:
    """Once a second from 60 s before the migration: the guest on A at ``iops_a`` until the switch (1002.5),
    on B at ``iops_b`` after it; B's device ``reads_b`` 4 KiB reads a second; half the set resident on B
    after 20 s, all of it after 40 s."""
    out = []
    for i in range(seconds + 60):
        t = 940.0 + i
        after = t - 1002.5
        b = after >= 0
        out.append({"t": t, "where": "b" if b else "a", "ios": int(after * iops_b) if b else int((t - 940) * iops_a),
                    "reads": [0, max(0, int(after * reads_b))], "read_bytes": [0, max(0, int(after * reads_b)) * 4096],
                    "set": [100, 0 if after < 20 else 50 if after < 40 else 100]})
    return out


def test_run_figures_count_b_from_the_resume_and_a_before_the_migration_began() -> None:
    f = run_figures(samples(), timeline(), set_bytes=100)
    w = f["windows"]
    assert w["0-10"]["iops"] == pytest.approx(100, abs=1) and w["0-10"]["whole"]
    assert w["60-120"]["iops"] == pytest.approx(100, abs=1) and w["0-60"]["covered_s"] == 60
    assert w["0-10"]["device_reads"] == pytest.approx(800, abs=80)
    assert w["10-30"]["device_mib"] == pytest.approx(20 * 80 * 4096 / MIB, rel=0.05)
    assert w["all"]["device_pages_per_io"] == pytest.approx(0.8, rel=0.05)
    assert f["warm_ref"]["iops"] == pytest.approx(900, abs=1) and f["warm_ref"]["covered_s"] == 30
    assert 39 <= f["resident_s"] <= 41 and f["share_at_end"] == 1.0   # 90% of the set: the sample after 40 s
    assert f["a_set_share_at_start"] == 1.0 and f["migrate_s"] == 3.0 and f["switch_after_start_s"] == 2.5
    assert f["ended_by"] == "measure" and f["end_s"] == 120


def test_a_trace_that_ends_early_is_measured_up_to_its_end_and_windows_after_it_stay_empty() -> None:
    f = run_figures(samples(), timeline(work_end=1002.5 + 45), set_bytes=100)
    w = f["windows"]
    assert w["30-60"]["covered_s"] == 15 and not w["30-60"]["whole"]
    assert w["30-60"]["iops"] == pytest.approx(100, abs=1)
    assert w["60-120"] == {"covered_s": 0.0} and f["end_s"] == 45 and f["ended_by"] == "work"


def test_cpu_use_is_cores_per_program_in_the_reference_window_and_after_the_switch() -> None:
    runs = samples()
    for s in runs:   # QEMU a whole core throughout; the agent half a core on B only; the journal too little
        s["cpu"] = {"a/qemu": 1.0, "a/journald": 0.01} if s["where"] == "a" else {"b/qemu": 1.0, "b/vmcache-agent": 0.5}
    cpu = run_figures(runs, timeline(), set_bytes=100)["cpu"]
    assert cpu["ref"] == {"a/qemu": 1.0}
    assert list(cpu["0-60"]) == ["b/qemu", "b/vmcache-agent"]
    assert cpu["0-60"]["b/vmcache-agent"] == pytest.approx(0.5, abs=0.02)
    assert cpu["all"]["b/qemu"] == pytest.approx(1.0, abs=0.02)
    table = cpu_table([{"ok": True, "workload": "web", "device": "ssd", "mode": "vmcache", "figures": {"cpu": cpu}}])
    assert "| web-ssd-vmcache | 0-60 | - | 1.00 (1.00-1.00) | 0.50 (0.50-0.50) |" in table and "journald" not in table


def test_without_the_resume_event_b_counts_from_its_first_sample() -> None:
    ios_b = [(1003.5, 100.0), (1004.5, 200.0)]
    tl = timeline(switch=1003.0, resumed=False)
    w = window_figures(ios_b, [(1003.0, 0), (1005.0, 10)], [(1003.0, 0), (1005.0, 4096)], tl)
    assert w["0-10"]["covered_s"] == 1.0 and w["0-10"]["iops"] == 100


def test_the_agents_loads_are_the_reads_inside_its_pins_before_they_were_made() -> None:
    text = "10.0 img.raw 0 131072\n10.5 img.raw 1048576 4096\n11.0 other.raw 0 4096\n12.5 img.raw 0 4096\n9.0 img.raw 0 4096\n13.0 img.r"
    reads = parse_reads(text)
    assert len(reads) == 5 and reads[0] == Read(10.0, "img.raw", 0, 131072)
    pins = parse_pins([(12.0, "pin.add start=0 length=65536 priority=3.5"), (12.2, "pin.apply regions=1"),
                       (12.1, "pin.add start=0 length=1048576 priority=2")])
    assert pins == [Pin(12.0, 0, 65536), Pin(12.1, 0, 1048576)]
    # the first read inside both pins (counted once), the one at 1 MiB outside them, the one after the pins, on
    # another image and before the switch not at all
    assert loaded_bytes(reads, pins, "img.raw", since=9.5, until=20) == 131072
    assert loaded_bytes(reads, pins, "img.raw", since=9.5, until=9.9) == 0   # after the run's end: not its
    line = "warm.done image=/x/img.raw restored=215 given_up=0 total=215"
    assert value_of(line, "restored") == "215" and value_of(line, "total") == "215" and value_of(line, "up") is None


def run(arm: str, round_: int, windows: dict[str, float], ref: float = 1000.0, ok: bool = True, **fig: object) -> dict:
    workload, device, mode = arm.split("-")
    w = {name: {"iops": v, "covered_s": 10.0, "whole": True, "device_reads": v / 10, "device_mib": v / 1000,
                "device_pages_per_io": 0.5 if mode == "vmcache" else 0.6}
         for name, v in windows.items()}
    w["all"] = dict(w["0-60"])
    return {"arm": arm, "workload": workload, "device": device, "mode": mode, "round": round_, "ok": ok,
            "figures": {"windows": w, "warm_ref": {"iops": ref}, "end_s": 120.0, "measure_s": 120.0,
                        "ended_by": "measure", **fig}}


def windows(v: float) -> dict[str, float]:
    return {"0-10": v, "10-30": v, "30-60": v, "60-120": v, "0-60": v}


def test_ratios_pair_the_arms_within_each_round_and_skip_failed_runs() -> None:
    runs = [run("zoned-hdd-kernel", 1, windows(200)), run("zoned-hdd-vmcache", 1, windows(800)),
            run("zoned-hdd-kernel", 2, windows(250)), run("zoned-hdd-vmcache", 2, windows(500)),
            run("zoned-hdd-kernel", 3, windows(100), ok=False), run("zoned-hdd-vmcache", 3, windows(900))]
    assert paired(runs, "zoned", "hdd", lambda r: r["figures"]["windows"]["0-60"]["iops"]) == [4.0, 2.0]
    table = goal_table(runs)
    assert "| zoned, first 60 s after the switch: vmcache vs the kernel alone | hdd | 3.00 (2.00-4.00) | 2 | >= 3.0 | met |" in table
    # vmcache over its own warm reference (1000 IOPS on A): every good vmcache run
    assert "vs its warm reference on A | hdd | 0.80 (0.50-0.90) | 3 | >= 0.8 | met |" in table
    assert "ssd" not in table and "web" not in table   # only what ran
    arms = iops_table(runs)
    assert "| zoned-hdd-vmcache | 3/3 | 1000 (1000-1000) | 800 (500-900) |" in arms
    assert arms.rstrip().endswith("| 3.00 (2.00-4.00) | 0.80 (0.50-0.90) |")
    assert "| zoned-hdd-kernel | 2/3 |" in arms
    runs.append(run("zoned-hdd-inferred", 1, windows(300)))   # a third arm is paired with the kernel's too
    assert paired(runs, "zoned", "hdd", lambda r: r["figures"]["windows"]["0-60"]["iops"], "inferred") == [1.5]
    assert "| zoned-hdd-inferred | 1/1 |" in iops_table(runs)


def test_the_web_goals_want_no_window_below_the_kernel_and_no_more_device_reads() -> None:
    runs = [run("web-ssd-kernel", 1, windows(300)), run("web-ssd-vmcache", 1, {**windows(300), "0-10": 270}),
            run("web-ssd-kernel", 2, windows(300)), run("web-ssd-vmcache", 2, {**windows(310), "0-10": 280})]
    table = goal_table(runs)
    assert "| web trace, 0-10 s after the switch: vmcache vs the kernel alone (no window below) | ssd | 0.92 (0.90-0.93) | 2 | >= 0.97 | missed |" in table
    assert "| web trace, 10-30 s after the switch: vmcache vs the kernel alone (no window below) | ssd | 1.02 (1.00-1.03) | 2 | >= 0.97 | met (no difference) |" in table
    assert "| web trace, device reads per guest I/O after the switch: vmcache vs the kernel alone (no more) | ssd | 0.83 (0.83-0.83) | 2 | <= 1.0 | met |" in table
    assert "| web-ssd-vmcache | 28 (27-28); 0.3 MiB | 30 (30-31); 0.3 MiB |" in reads_table(runs)
    assert len([g for g in GOALS if g.workload == "web"]) == 6


def test_partial_windows_are_marked_and_named() -> None:
    short = run("web-ssd-kernel", 1, windows(300))
    short["figures"].update(end_s=45.0, ended_by="work")
    short["figures"]["windows"]["30-60"].update(whole=False, covered_s=15.0)
    assert "300 (300-300)*" in iops_table([short])
    assert partial_note([short]).startswith("\\* covered in part: web-ssd-kernel round 1 measured 45 s after the "
                                            "switch (the trace's measured part ended)")
    assert partial_note([run("web-ssd-kernel", 1, windows(300))]) == ""


def test_the_set_table_shows_the_agents_figures_and_the_runs_that_never_had_the_set_resident() -> None:
    runs = [run("zoned-hdd-vmcache", r, windows(800), resident_s=s, warm_done_s=4.0, loaded_mib=205.0,
                carried_mib=205.0, a_pinned_mib=205.0, migrate_s=2.5, on_a_s=70, load_end=3.1, share_at_end=0.95,
                read_signal_a="inferred", read_signal_b="inferred") for r, s in ((1, 5.0), (2, None))]
    runs[0]["why_moved"], runs[1]["why_moved"] = "pinned", "cap"
    table = set_table(runs)
    assert "| zoned-hdd-vmcache | 2.50 (2.50-2.50) | 5.0 (5.0-5.0) (1 not in the run) | 0.95 (0.95-0.95) | 4.0 (4.0-4.0) |" in table
    assert "| 70 (70-70) (cap 1, pinned 1) | inferred/inferred | 3.1 (3.1-3.1) |" in table
