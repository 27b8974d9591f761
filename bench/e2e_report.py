"""Figures and tables of the end-to-end bench: medians over rounds, per-round ratios, goals.

Pure functions over plain data (fio's JSON jobs, per-run dicts): unit
tested in tests/unit/test_bench_report.py.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from bench.e2e_arms import AGENT_MODES

MIB = 1 << 20


def figures(jobs: list[dict]) -> dict:
    """IOPS and latencies over one arm's measured fio runs (several for the periodic scenario).

    IOPS are total I/Os over total runtime; latencies are I/O-weighted means
    of fio's means and the worst p99.
    """
    if not jobs:
        return {}
    out: dict = {}
    seconds = sum(j["read"]["runtime"] for j in jobs) / 1000 or 1.0
    for d in ("read", "write"):
        ios = sum(j[d]["total_ios"] for j in jobs)
        out[f"{d}_iops"] = ios / seconds
        out[f"{d}_lat_mean_us"] = (sum(j[d]["lat_ns"]["mean"] * j[d]["total_ios"] for j in jobs) / ios / 1000
                                   if ios else 0.0)
        out[f"{d}_lat_p99_us"] = max(j[d].get("clat_ns", {}).get("percentile", {}).get("99.000000", 0)
                                     for j in jobs) / 1000
    out["iops"] = out["read_iops"] + out["write_iops"]
    return out


@dataclass(frozen=True)
class Spread:
    median: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: list[float]) -> "Spread | None":
        if not values:
            return None
        return cls(statistics.median(values), min(values), max(values), len(values))

    def fmt(self, digits: int = 0) -> str:
        return f"{self.median:.{digits}f} ({self.low:.{digits}f}-{self.high:.{digits}f})"


def paired_ratios(runs: list[dict], arm: str, reference: str, *more: str) -> list[float]:
    """Ratio of total IOPS of ``arm`` to ``reference`` within each round where both ran; with ``more``
    references, to the best of those that ran that round (all must have run, or the round is left out)."""
    refs = (reference, *more)
    by_round: dict[int, dict[str, float]] = {}
    for r in runs:
        if r["ok"]:
            by_round.setdefault(r["round"], {})[r["arm"]] = r["figures"]["iops"]
    return [v[arm] / best for v in by_round.values()
            if arm in v and all(x in v for x in refs) and (best := max(v[x] for x in refs))]


def best_of(runs: list[dict], references: tuple[str, ...]) -> dict[int, str]:
    """Per round, which of ``references`` had the most IOPS (the rounds where all of them ran)."""
    by_round: dict[int, dict[str, float]] = {}
    for r in runs:
        if r["ok"] and r["arm"] in references:
            by_round.setdefault(r["round"], {})[r["arm"]] = r["figures"]["iops"]
    return {rnd: max(v, key=lambda a: v[a]) for rnd, v in by_round.items() if len(v) == len(references)}


def verdict(ratios: Spread | None, target: float | None = None) -> str:
    """"no difference" when the rounds' ratios straddle 1; with a target, whether the median reaches it."""
    if ratios is None:
        return "not run"
    same = ratios.low <= 1.0 <= ratios.high
    if target is None:
        return "no difference" if same else ("better" if ratios.median > 1 else "worse")
    if target > 1.0 and same:
        return "missed (no difference)"
    met = "met" if ratios.median >= target else "missed"
    return f"{met} (no difference)" if same else met


def miss_figures(device_read: dict[str, int], guest_reads: int, guest_writes: int = 0) -> dict[str, float]:
    """Misses per guest read in the measured run, from what storage served (bench/e2e_sample.py device_reads),
    and the device's 4 KiB reads per guest I/O (reads and writes: what the run cost the shared device per
    unit of the guest's work, the agent's own loading included).

    On the delay device: ``device`` bytes and ``device_requests`` (read requests that missed, readahead
    included); on the real disk: ``qemu`` and ``agent`` bytes from /proc/PID/io. Pages are 4 KiB.
    """
    if not device_read or not guest_reads:
        return {}
    pages = (device_read["device"] if "device" in device_read else sum(device_read.values())) / 4096
    out = {"device_reads_per_guest_read": pages / guest_reads,
           "device_reads_per_guest_io": pages / (guest_reads + guest_writes)}
    if "device" in device_read:
        out["device_requests_per_guest_read"] = device_read.get("device_requests", 0) / guest_reads
    else:
        out.update({f"{who}_device_reads_per_guest_read": value / 4096 / guest_reads
                    for who, value in device_read.items()})
    return out


def device_check_line(describe: str, check: dict) -> str:
    """One device's host fio check (bench/e2e.py CHECKS) as a line: mean (p50, p99) latencies and IOPS."""
    def lat(case: str) -> str:
        c = check[case]
        return f"{c['lat_mean_us']} us (p50 {c['lat_p50_us']}, p99 {c['lat_p99_us']})"
    parts = [f"miss {lat('miss')}, {check['miss']['iops']} IOPS"]
    if "miss_32" in check:
        parts.append(f"32 parallel misses {check['miss_32']['iops']} IOPS, each {lat('miss_32')}")
    parts += [f"hit {lat('hit')}", f"4 KiB O_SYNC write {lat('sync_write')}"]
    return f"{describe}: host fio 4 KiB psync, " + "; ".join(parts)


def arm_table(arm_names: list[str], runs: list[dict], reference: dict[str, str]) -> str:
    """One line per arm: IOPS, read latency, ratio to its group's reference, agent, load; medians (min-max)."""
    lines = ["| arm | runs | IOPS (r+w) | read mean us | device reads / guest read | device reads / guest I/O "
             "| x ref (per round) | ref | agent CPU % | of the reads, agent's | pinned MiB | load 1-min "
             "| host CPU busy % |",
             "|" + "---|" * 13]
    for name in arm_names:
        mine = [r for r in runs if r["arm"] == name]
        ok = [r for r in mine if r["ok"]]
        if not ok:
            errs = "; ".join(sorted({r["error"] or "?" for r in mine}))
            lines.append(f"| {name} | 0/{len(mine)} | failed: {errs} |" + " |" * 10)
            continue
        col = lambda key: Spread.of([r["figures"][key] for r in ok if key in r["figures"]])  # noqa: E731
        misses = col("device_reads_per_guest_read")
        per_io = col("device_reads_per_guest_io")
        agent_reads = col("agent_device_reads_per_guest_read")
        ref = reference.get(name, "")
        ratio = Spread.of(paired_ratios(runs, name, ref)) if ref and ref != name else None
        cpu = Spread.of([sum(a["cpu_percent"] for a in r["agents"]) for r in ok if r.get("agents") and
                         all(a.get("cpu_percent") is not None for a in r["agents"])])
        pinned = Spread.of([r["pinned_end"] / MIB for r in ok if r.get("pinned_end") is not None])
        load = Spread.of([r["load"]["end"] for r in ok if "end" in r.get("load", {})])
        busy = Spread.of([r["load"]["host_busy_percent"] for r in ok if "host_busy_percent" in r.get("load", {})])
        lines.append(
            f"| {name} | {len(ok)}/{len(mine)} | {col('iops').fmt()} | {col('read_lat_mean_us').fmt()} "
            f"| {misses.fmt(2) if misses else ''} | {per_io.fmt(2) if per_io else ''} "
            f"| {ratio.fmt(2) if ratio else ''} | {ref if ratio else ''} "
            f"| {cpu.fmt(1) if cpu else ''} "
            f"| {agent_reads.fmt(2) if agent_reads and name.rsplit('-', 1)[-1] in AGENT_MODES else ''} "
            f"| {pinned.fmt() if pinned else ''} "
            f"| {load.fmt(1) if load else ''} | {busy.fmt() if busy else ''} |")
    return "\n".join(lines)


def goal_table(goals: list, runs: list[dict]) -> str:
    """The goals: median of per-round ratios with min-max, the target and the verdict, and beside each
    ratio the device reads per guest I/O of both sides (harm to a shared device that IOPS would hide)."""
    lines = ["| goal | arms | ratio, median (min-max) | rounds | target | verdict "
             "| device reads / guest I/O: arm, reference |", "|---|---|---|---|---|---|---|"]
    for g in goals:
        refs = g.references
        ratios = Spread.of(paired_ratios(runs, g.arm, *refs))
        if ratios is None:
            continue
        names = refs[0] if len(refs) == 1 else "best of " + ", ".join(refs)
        best = best_of(runs, refs) if len(refs) > 1 else {}
        if best:
            names += " (" + ", ".join(f"r{rnd}: {a.rsplit('-', 1)[-1]}" for rnd, a in sorted(best.items())) + ")"
        io = lambda arms: Spread.of([r["figures"]["device_reads_per_guest_io"] for r in runs  # noqa: E731
                                     if r["ok"] and r["arm"] in arms and "device_reads_per_guest_io" in r["figures"]])
        mine, theirs = io((g.arm,)), io(refs)
        lines.append(f"| {g.label} | {g.arm} / {names} | {ratios.fmt(2)} | {ratios.n} "
                     f"| >= {g.target} | {verdict(ratios, g.target)} "
                     f"| {mine.fmt(2) if mine else '-'}, {theirs.fmt(2) if theirs else '-'} |")
    return "\n".join(lines)


def time_to_steady(samples: list[dict], steady_iops: float, fraction: float = 0.9, window: int = 5) -> float | None:
    """Seconds from the start of the measured run until the guest's IOPS, averaged over ``window`` s,
    first reach ``fraction`` of ``steady_iops``; None if they never do (or there are no I/O samples).

    ``samples``: the run's once-a-second rows with ``t`` (s), ``measuring`` and ``ios`` (requests so
    far); rows after the measured run count too (a boot scenario's steady run follows it).
    """
    first = next((i for i, r in enumerate(samples) if r.get("measuring")), None)
    rows = [r for r in samples[first:] if r.get("ios") is not None] if first is not None else []
    if len(rows) <= window or steady_iops <= 0:
        return None
    start = rows[0]["t"]
    for a, b in zip(rows, rows[window:]):
        if b["t"] > a["t"] and (b["ios"] - a["ios"]) / (b["t"] - a["t"]) >= fraction * steady_iops:
            return round(b["t"] - start, 1)
    return None


def boot_table(arm_names: list[str], runs: list[dict]) -> str:
    """Boot scenarios: IOPS of the first run from boot, the steady IOPS after it, the time to 90% of those."""
    lines = ["| arm | runs | IOPS, first run from boot | steady IOPS (the run after) | s to 90% of steady |",
             "|---|---|---|---|---|"]
    for name in arm_names:
        ok = [r for r in runs if r["arm"] == name and r["ok"] and "steady_iops" in r["figures"]]
        if not ok:
            continue
        col = lambda key: Spread.of([r["figures"][key] for r in ok if r["figures"].get(key) is not None])  # noqa: E731
        t90 = col("t90_seconds")
        never = sum(1 for r in ok if r["figures"].get("t90_seconds") is None)
        lines.append(f"| {name} | {len(ok)} | {col('iops').fmt()} | {col('steady_iops').fmt()} "
                     f"| {t90.fmt(1) if t90 else ''}{f' ({never} never)' if never else ''} |")
    return "\n".join(lines)
