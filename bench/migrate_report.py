"""Tables of the migration bench: per arm medians (min-max) over rounds, per-round ratios, the issue's goals.

Pure (per-run dicts as bench/migrate_bench.py writes them, Markdown out):
unit tested in tests/unit/test_bench_migrate.py. A run's ``figures`` are
bench/migrate_windows.py's: ``windows`` (per window ``iops``,
``device_reads``, ``device_mib``, ``covered_s``, ``whole``; ``all``: from the
switch to the run's end, with ``device_pages_per_io``), ``warm_ref``
(``iops`` on A before the migration began), ``resident`` and the agent's
figures. Ratios are taken within each round, between the arms of one
workload and device (vmcache over kernel), or within one run (vmcache over
its own warm reference).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from bench.e2e_report import Spread, verdict
from bench.migrate_windows import WINDOWS, label

WINDOW_NAMES = tuple(label(w) for w in WINDOWS)
MODES = ("kernel", "vmcache", "inferred")


@dataclass(frozen=True)
class Goal:
    """A goal of issue 41 item 5: vmcache's ``measure`` in ``window`` against ``target``.

    ``measure``: ``kernel`` (IOPS, vmcache over the kernel alone, same round), ``warm`` (IOPS, vmcache
    over its own warm reference on A), ``reads`` (device pages per guest I/O, vmcache over the kernel:
    at most ``target``). ``device`` None: every device the workload ran on.
    """

    label: str
    workload: str
    device: str | None
    measure: str
    window: str
    target: float


GOALS = (
    Goal("zoned, first 60 s after the switch: vmcache vs the kernel alone", "zoned", "hdd", "kernel", "0-60", 3.0),
    Goal("zoned, first 60 s after the switch: vmcache vs the kernel alone", "zoned", "ssd", "kernel", "0-60", 1.5),
    Goal("zoned, first 60 s after the switch: vmcache vs its warm reference on A", "zoned", None, "warm", "0-60", 0.8),
    *(Goal(f"web trace, {w} s after the switch: vmcache vs the kernel alone (no window below)", "web", None,
           "kernel", w, 0.97) for w in WINDOW_NAMES),
    Goal("web trace, device reads per guest I/O after the switch: vmcache vs the kernel alone (no more)", "web",
         None, "reads", "all", 1.0),
)


def arm_name(workload: str, device: str, mode: str) -> str:
    return f"{workload}-{device}-{mode}"


def _window(run: dict, window: str, key: str = "iops") -> float | None:
    value = run["figures"]["windows"].get(window, {}).get(key)
    return None if value is None else float(value)


def _warm_ratio(run: dict, window: str) -> float | None:
    ref = run["figures"].get("warm_ref")
    value = _window(run, window)
    return value / ref["iops"] if value is not None and ref and ref["iops"] else None


def paired(runs: list[dict], workload: str, device: str, value: Callable[[dict], float | None],
           mode: str = "vmcache") -> list[float]:
    """``mode``'s ``value`` over the kernel's, within each round where both arms ran and have it."""
    by_round: dict[int, dict[str, float]] = {}
    for r in runs:
        if r["ok"] and r["workload"] == workload and r["device"] == device and (v := value(r)) is not None:
            by_round.setdefault(r["round"], {})[r["mode"]] = v
    return [v[mode] / v["kernel"] for _, v in sorted(by_round.items()) if mode in v and v.get("kernel")]


def own(runs: list[dict], workload: str, device: str, mode: str, value: Callable[[dict], float | None]) -> list[float]:
    """``value`` of every good run of one arm."""
    return [v for r in runs if r["ok"] and (r["workload"], r["device"], r["mode"]) == (workload, device, mode)
            and (v := value(r)) is not None]


def goal_ratios(goal: Goal, runs: list[dict], device: str) -> list[float]:
    if goal.measure == "warm":
        return own(runs, goal.workload, device, "vmcache", lambda r: _warm_ratio(r, goal.window))
    key = "device_pages_per_io" if goal.measure == "reads" else "iops"
    return paired(runs, goal.workload, device, lambda r: _window(r, goal.window, key))


def at_most(ratios: Spread | None, target: float) -> str:
    """The verdict of a goal whose ratio must stay at or under ``target`` (e2e's verdict on the inverses)."""
    if ratios is None:
        return "not run"
    return verdict(Spread(1 / ratios.median, 1 / ratios.high, 1 / ratios.low, ratios.n), 1 / target)


def goal_table(runs: list[dict], goals: tuple[Goal, ...] = GOALS) -> str:
    lines = ["| goal | device | ratio, median (min-max) | rounds | target | verdict |", "|---|---|---|---|---|---|"]
    devices = sorted({r["device"] for r in runs})
    for g in goals:
        for device in ([g.device] if g.device else devices):
            if not any(r["workload"] == g.workload and r["device"] == device for r in runs):
                continue
            ratios = Spread.of(goal_ratios(g, runs, device))
            if g.measure == "reads":
                target, judged = f"<= {g.target}", at_most(ratios, g.target)
            else:
                target, judged = f">= {g.target}", verdict(ratios, g.target)
            if ratios is None:
                judged = "no figures (window not reached?)"
            lines.append(f"| {g.label} | {device} | {ratios.fmt(2) if ratios else '-'} | {ratios.n if ratios else 0} "
                         f"| {target} | {judged} |")
    return "\n".join(lines)


def _arms(runs: list[dict]) -> list[tuple[str, str, str]]:
    seen = {(r["workload"], r["device"], r["mode"]) for r in runs}
    return sorted(seen, key=lambda a: (a[0], a[1], MODES.index(a[2]) if a[2] in MODES else 9))


def _cell(values: list[float], digits: int = 0, partial: bool = False) -> str:
    s = Spread.of(values)
    return "-" if s is None else s.fmt(digits) + ("*" if partial else "")


def _partial(runs: list[dict], arm: tuple[str, str, str], window: str) -> bool:
    return any(not r["figures"]["windows"].get(window, {}).get("whole", True) for r in runs
               if r["ok"] and (r["workload"], r["device"], r["mode"]) == arm
               and r["figures"]["windows"].get(window, {}).get("covered_s"))


def iops_table(runs: list[dict]) -> str:
    """Per arm: the warm reference, IOPS per window after the switch, vmcache's ratios (within each round)."""
    head = " | ".join(f"IOPS {w} s" for w in WINDOW_NAMES)
    lines = [f"| arm | runs | warm ref IOPS on A | {head} | x kernel 0-60 | x warm ref 0-60 |",
             "|" + "---|" * (len(WINDOW_NAMES) + 5)]
    for arm in _arms(runs):
        mine = [r for r in runs if (r["workload"], r["device"], r["mode"]) == arm]
        ok = [r for r in mine if r["ok"]]
        ref = [r["figures"]["warm_ref"]["iops"] for r in ok if r["figures"].get("warm_ref")]
        cells = [_cell(own(runs, *arm, lambda r, w=w: _window(r, w)), partial=_partial(runs, arm, w))
                 for w in WINDOW_NAMES]
        vs_kernel = vs_warm = "-"
        if arm[2] != "kernel":
            vs_kernel = _cell(paired(runs, arm[0], arm[1], lambda r: _window(r, "0-60"), arm[2]), 2)
            vs_warm = _cell(own(runs, *arm, lambda r: _warm_ratio(r, "0-60")), 2)
        lines.append(f"| {arm_name(*arm)} | {len(ok)}/{len(mine)} | {_cell(ref)} | {' | '.join(cells)} "
                     f"| {vs_kernel} | {vs_warm} |")
    return "\n".join(lines)


def reads_table(runs: list[dict]) -> str:
    """Per arm: the device's read requests (median, min-max) and MiB (median) in each window after the switch,
    both mounts together."""
    head = " | ".join(f"{w} s" for w in WINDOW_NAMES)
    lines = [f"| arm | device reads: requests (min-max); MiB, {head} | 4 KiB pages per guest I/O after the switch |",
             "|" + "---|" * (len(WINDOW_NAMES) + 2)]
    for arm in _arms(runs):
        cells = []
        for w in WINDOW_NAMES:
            req = _cell(own(runs, *arm, lambda r, w=w: _window(r, w, "device_reads")))
            mib = Spread.of(own(runs, *arm, lambda r, w=w: _window(r, w, "device_mib")))
            cells.append("-" if mib is None else f"{req}; {mib.median:.1f} MiB")
        per_io = _cell(own(runs, *arm, lambda r: _window(r, "all", "device_pages_per_io")), 2)
        lines.append(f"| {arm_name(*arm)} | {' | '.join(cells)} | {per_io} |")
    return "\n".join(lines)


def _figure(key: str, scale: float = 1.0) -> Callable[[dict], float | None]:
    def get(r: dict) -> float | None:
        v = r["figures"].get(key)
        return None if v is None else float(v) / scale
    return get


def set_table(runs: list[dict]) -> str:
    """Per arm: the migration, the set on B (resident, the agent's restore, its loads), A's pins, the load."""
    lines = ["| arm | migrate s | set 90% resident on B, s after the switch | share resident at the end "
             "| B's warm.done, s | loaded on B MiB | carried set MiB | pinned on A as the migration began MiB "
             "| s on A (moved when) | reads signal A/B | load 1-min |",
             "|" + "---|" * 11]
    for arm in _arms(runs):
        ok = [r for r in runs if r["ok"] and (r["workload"], r["device"], r["mode"]) == arm]
        col = lambda key, digits=1: _cell(own(runs, *arm, _figure(key)), digits)  # noqa: E731
        never = sum(1 for r in ok if r["figures"].get("resident_s") is None)
        resident = col("resident_s") + (f" ({never} not in the run)" if never else "")
        moved = ", ".join(f"{why} {n}" for why, n in sorted(Counter(r.get("why_moved") or "?" for r in ok).items()))
        signals = sorted({f"{r['figures'].get('read_signal_a') or '-'}/{r['figures'].get('read_signal_b') or '-'}"
                          for r in ok})
        lines.append(f"| {arm_name(*arm)} | {col('migrate_s', 2)} | {resident} | {col('share_at_end', 2)} "
                     f"| {col('warm_done_s')} | {col('loaded_mib')} | {col('carried_mib')} | {col('a_pinned_mib')} "
                     f"| {col('on_a_s', 0)} ({moved or '-'}) | {', '.join(signals) or '-'} | {col('load_end')} |")
    return "\n".join(lines)


def cpu_table(runs: list[dict], least: float = 0.05) -> str:
    """Per arm and window (the warm reference's on A, 0-60 s after the switch on B): the cores each program
    used, median (min-max) over rounds, for the programs using ``least`` or more in some arm (bench/proc_cpu.py)."""
    cores: dict[tuple[str, str, str, str], dict[str, list[float]]] = {}
    for r in runs:
        for window, used in (r["figures"].get("cpu") or {}).items() if r["ok"] else ():
            if window == "all":
                continue
            cell = cores.setdefault((r["workload"], r["device"], r["mode"], window), {})
            for program, value in used.items():
                cell.setdefault(program, []).append(value)
    programs = sorted({p for cell in cores.values() for p, v in cell.items() if Spread.of(v).median >= least})
    if not programs:
        return ""
    lines = [f"| arm | window | {' | '.join(programs)} |", "|" + "---|" * (len(programs) + 2)]
    for (workload, device, mode, window), cell in sorted(cores.items()):
        values = [_cell(cell.get(p, []), 2) for p in programs]
        lines.append(f"| {arm_name(workload, device, mode)} | {window} | {' | '.join(values)} |")
    return "Cores used, by host and program:\n\n" + "\n".join(lines)


def partial_note(runs: list[dict]) -> str:
    """A line naming the runs that measured less than the last window (120 s after the switch): the trace's
    measured part ended, or a shorter ``--measure``. Their figures of a window they reached in part (marked *)
    are over the part they covered."""
    last = max(w[1] for w in WINDOWS)
    short = sorted({(r["arm"], r["round"], round(r["figures"]["end_s"]), r["figures"]["ended_by"]) for r in runs
                    if r["ok"] and r["figures"]["end_s"] < last})
    if not short:
        return ""
    why = {"work": "the trace's measured part ended", "measure": "--measure"}
    return ("\\* covered in part: " + "; ".join(f"{arm} round {rnd} measured {s} s after the switch ({why[by]})"
                                             for arm, rnd, s, by in short)
            + "; a window it reached in part is over what there is, one it did not reach is -.")
