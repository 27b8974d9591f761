"""Is a process still the one we knew? pid + start time from /proc (pid reuse safe)."""

from __future__ import annotations

import os

__all__ = ["start_time", "is_alive", "cmdline"]


def start_time(pid: int, *, proc: str = "/proc") -> int | None:
    """Start time of ``pid`` (clock ticks since boot), None if it is gone or a zombie."""
    try:
        with open(f"{proc}/{int(pid)}/stat", "rb") as f:
            stat = f.read()
    except (OSError, ValueError):
        return None
    fields = stat[stat.rfind(b")") + 2:].split()
    # fields[0] is field 3 of proc(5) (state); starttime is field 22
    if len(fields) < 20 or fields[0] in (b"Z", b"X"):
        return None
    try:
        return int(fields[19])
    except ValueError:
        return None


def is_alive(pid: int | None, started: int | None = None, *, proc: str = "/proc") -> bool:
    """True when ``pid`` runs and, if ``started`` is given, is the process that started then."""
    if pid is None or pid <= 0:
        return False
    now = start_time(pid, proc=proc)
    return now is not None and (started is None or now == started)


def cmdline(pid: int, *, proc: str = "/proc") -> list[str] | None:
    """The argv of ``pid``, None if it is gone."""
    try:
        with open(f"{proc}/{int(pid)}/cmdline", "rb") as f:
            raw = f.read()
    except (OSError, ValueError):
        return None
    return [os.fsdecode(a) for a in raw.split(b"\0")[:-1]] if raw else []
