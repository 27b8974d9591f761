"""One migration run's figures from its samples: counts and rates in windows after the switch.

Pure (plain numbers in, plain numbers out): unit tested in
tests/unit/test_bench_migrate.py; bench/migrate_sample.py takes the samples.

A *series* is ``[(t, value), ...]`` of a counter that only grows (the
guest's requests from libvirt's block stats, the delay devices' reads), in
time order. Between two samples the counter is taken to grow evenly, so a
window ``[a, b]`` is read at its ends by linear interpolation, over the part
of it the series covers: a window the run did not reach counts nothing
(None), one it reached in part says how many of its seconds it covers.
Windows are in seconds after the *switch*: B's resume event (the guest runs
on B from then), or the end of the migrate command where no event came.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

WINDOWS = ((0, 10), (10, 30), (30, 60), (60, 120), (0, 60))
REFERENCE = 30.0      # seconds before the migration began: the warm reference's window
RESIDENT = 0.9        # share of the set resident on B that counts as "resident"
PAGE = 4096
MIB = 1 << 20

Series = Sequence[tuple[float, float]]


def label(window: tuple[float, float]) -> str:
    return f"{window[0]:g}-{window[1]:g}"


@dataclass(frozen=True)
class Span:
    """What a counter did in a window: its growth over the ``covered`` seconds of the window's ``length``."""

    delta: float
    covered: float
    length: float

    @property
    def rate(self) -> float:
        return self.delta / self.covered

    @property
    def whole(self) -> bool:
        return self.covered >= self.length - 1e-6


def at(series: Series, t: float) -> float:
    """The counter at ``t`` (within the series' range), linearly between the samples around it."""
    if not series or not series[0][0] <= t <= series[-1][0]:
        raise ValueError(f"{t} is outside the series")
    for (t0, v0), (t1, v1) in zip(series, series[1:]):
        if t0 <= t <= t1:
            return v0 if t1 == t0 else v0 + (v1 - v0) * (t - t0) / (t1 - t0)
    return series[-1][1]   # one sample


def span(series: Series, start: float, end: float) -> Span | None:
    """The counter's growth in ``[start, end]``, over the part the series covers; None where it covers none."""
    if not series:
        return None
    lo, hi = max(start, series[0][0]), min(end, series[-1][0])
    if hi <= lo:
        return None
    return Span(at(series, hi) - at(series, lo), hi - lo, end - start)


def clip(series: Series, start: float | None = None, end: float | None = None) -> list[tuple[float, float]]:
    """The samples in ``[start, end]`` with the counter interpolated at both ends (where the series reaches them)."""
    if not series:
        return []
    lo = series[0][0] if start is None else max(start, series[0][0])
    hi = series[-1][0] if end is None else min(end, series[-1][0])
    if hi < lo:
        return []
    inner = [(t, v) for t, v in series if lo < t < hi]
    return [(lo, at(series, lo)), *inner, *([(hi, at(series, hi))] if hi > lo else [])]


def first_reaching(series: Series, threshold: float) -> float | None:
    """The time of the first sample at or above ``threshold`` (a level, not a counter); None if none is."""
    return next((t for t, v in series if v >= threshold), None)


def shifted(series: Series, origin: float) -> list[tuple[float, float]]:
    return [(t - origin, v) for t, v in series]


@dataclass(frozen=True)
class Timeline:
    """When things happened in one run (wall times, s): the migration's start and end, the switch, and where
    the guest's measured work ended (None: it ran past the measurement)."""

    migrate_start: float
    migrate_end: float
    switch: float
    measure: float                 # seconds measured after the switch
    work_end: float | None = None  # the trace's measured part ended (its VMCACHE-FIO-END)
    resumed: bool = True           # the switch is B's resume event (not the command's end)

    @property
    def end(self) -> float:
        """Seconds after the switch up to which the run counts."""
        return self.measure if self.work_end is None else min(self.measure, self.work_end - self.switch)


def window_figures(ios_b: Series, reads: Series, read_bytes: Series, tl: Timeline) -> dict[str, dict]:
    """Per window after the switch (WINDOWS and ``all``, 0 to the run's end): the guest's IOPS on B, the
    device's read requests and MiB (both mounts), the seconds covered; series in wall time."""
    ios, req, byt = (clip(shifted(s, tl.switch), 0.0, tl.end) for s in (ios_b, reads, read_bytes))
    out: dict[str, dict] = {}
    for name, window in [*((label(w), w) for w in WINDOWS), ("all", (0.0, tl.end))]:
        io, r, b = span(ios, *window), span(req, *window), span(byt, *window)
        if io is None or r is None or b is None:
            out[name] = {"covered_s": 0.0}
            continue
        out[name] = {"iops": io.rate, "ios": io.delta, "covered_s": round(io.covered, 2), "whole": io.whole,
                     "device_reads": r.delta, "device_mib": b.delta / MIB,
                     "device_pages_per_io": b.delta / PAGE / io.delta if io.delta else None}
    return out


def warm_reference(ios_a: Series, tl: Timeline, seconds: float = REFERENCE) -> dict | None:
    """The guest's IOPS on A in the ``seconds`` before the migration began (None: no samples there)."""
    s = span(ios_a, tl.migrate_start - seconds, tl.migrate_start)
    return None if s is None else {"iops": s.rate, "covered_s": round(s.covered, 2)}


def resident_after(set_b: Series, set_bytes: int, tl: Timeline) -> dict:
    """When the set was ``RESIDENT`` resident on B after the switch (None: not within the run), and the share
    resident at its end; ``set_b``: (wall time, bytes of the set resident on B)."""
    after = [(t, v) for t, v in shifted(set_b, tl.switch) if 0 <= t <= tl.end]
    reached = first_reaching(after, RESIDENT * set_bytes) if set_bytes else None
    return {"resident_s": None if reached is None else round(reached, 2),
            "share_at_end": round(after[-1][1] / set_bytes, 3) if after and set_bytes else None}


def cpu_use(samples: list[dict], tl: Timeline, least: float = 0.02) -> dict[str, dict[str, float]]:
    """Cores each program used (CPU seconds a second, bench/proc_cpu.py labels) in the warm reference's
    window on A (``ref``) and in 0-60 s and the whole run after the switch (``all``): those using ``least``
    or more, most first. A sample's CPU is what was used since the one before it."""
    windows = {"ref": (tl.migrate_start - REFERENCE, tl.migrate_start),
               "0-60": (tl.switch, tl.switch + min(60.0, tl.end)), "all": (tl.switch, tl.switch + tl.end)}
    out: dict[str, dict[str, float]] = {}
    for name, (lo, hi) in windows.items():
        inside = [s.get("cpu", {}) for s in samples if lo < s["t"] <= hi]
        if not inside or hi <= lo:
            continue
        total: dict[str, float] = {}
        for cpu in inside:
            for program, seconds in cpu.items():
                total[program] = total.get(program, 0.0) + seconds
        cores = {p: round(v / (hi - lo), 3) for p, v in total.items() if v / (hi - lo) >= least}
        out[name] = dict(sorted(cores.items(), key=lambda kv: -kv[1]))
    return out


def run_figures(samples: list[dict], tl: Timeline, set_bytes: int) -> dict:
    """A run's figures from its once-a-second samples (bench/migrate_sample.py: ``t``, ``where`` the guest
    was counted, ``ios`` there, ``reads``/``read_bytes``/``set`` as [A's mount, B's mount])."""
    ios_a = [(s["t"], s["ios"]) for s in samples if s["where"] == "a" and s["ios"] is not None]
    # B's QEMU counts from zero and the guest issues nothing there before it resumes: at the resume event
    # the count is 0; after a switch known only from the command's end, B's samples alone.
    ios_b = [(tl.switch, 0)] if tl.resumed else []
    ios_b += [(s["t"], s["ios"]) for s in samples if s["where"] == "b" and s["ios"] is not None and s["t"] >= tl.switch]
    both = lambda key: [(s["t"], sum(s[key])) for s in samples]  # noqa: E731
    return {"windows": window_figures(ios_b, both("reads"), both("read_bytes"), tl),
            "warm_ref": warm_reference(ios_a, tl),
            **resident_after([(s["t"], s["set"][1]) for s in samples], set_bytes, tl),
            "a_set_share_at_start": _share_at(samples, tl.migrate_start, set_bytes),
            "migrate_s": round(tl.migrate_end - tl.migrate_start, 3),
            "switch_after_start_s": round(tl.switch - tl.migrate_start, 3),
            "end_s": round(tl.end, 2), "measure_s": tl.measure,
            "ended_by": "measure" if tl.end >= tl.measure else "work",
            "cpu": cpu_use(samples, tl)}


def _share_at(samples: list[dict], t: float, set_bytes: int) -> float | None:
    """The share of the set resident on A in the last sample before ``t``."""
    before = [s["set"][0] for s in samples if s["t"] <= t]
    return round(before[-1] / set_bytes, 3) if before and set_bytes else None
