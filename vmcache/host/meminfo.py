"""Host memory figures: /proc/meminfo and memory pressure (PSI).

Paths are arguments with the production files as defaults, so tests pass
recorded copies.
"""

from __future__ import annotations

import errno as _errno
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..errors import HostError

__all__ = [
    "MEMINFO_PATH",
    "PRESSURE_PATH",
    "MemInfo",
    "PressureLine",
    "MemoryPressure",
    "read_meminfo",
    "read_pressure",
    "parse_meminfo",
    "parse_pressure",
]

MEMINFO_PATH = "/proc/meminfo"
PRESSURE_PATH = "/proc/pressure/memory"

_UNITS = {"kB": 1024, "": 1}


@dataclass(frozen=True)
class MemInfo:
    """The /proc/meminfo figures vmcache uses, in bytes; ``fields`` holds every line."""

    total_bytes: int
    free_bytes: int
    available_bytes: int
    cached_bytes: int
    dirty_bytes: int
    mlocked_bytes: int
    unevictable_bytes: int
    fields: Mapping[str, int] = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class PressureLine:
    """One PSI line: share of time stalled over 10/60/300 s (percent), total stall (us)."""

    avg10: float
    avg60: float
    avg300: float
    total_us: int


@dataclass(frozen=True)
class MemoryPressure:
    """/proc/pressure/memory: ``some`` tasks stalled, and ``full`` (None where the kernel has no such line)."""

    some: PressureLine
    full: PressureLine | None


def parse_meminfo(text: str) -> MemInfo:
    """Parse the text of /proc/meminfo. Raises ValueError when MemTotal is missing."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        if not sep:
            continue
        parts = rest.split()
        if not parts or not parts[0].isdigit():
            continue
        unit = parts[1] if len(parts) > 1 else ""
        values[key.strip()] = int(parts[0]) * _UNITS.get(unit, 1)
    if "MemTotal" not in values:
        raise ValueError("no MemTotal line")
    free = values.get("MemFree", 0)
    # MemAvailable exists since Linux 3.14; before it, free memory is the safe guess.
    available = values.get("MemAvailable", free)
    return MemInfo(
        total_bytes=values["MemTotal"],
        free_bytes=free,
        available_bytes=available,
        cached_bytes=values.get("Cached", 0),
        dirty_bytes=values.get("Dirty", 0),
        mlocked_bytes=values.get("Mlocked", 0),
        unevictable_bytes=values.get("Unevictable", 0),
        fields=values,
    )


def read_meminfo(path: str = MEMINFO_PATH) -> MemInfo:
    """Read /proc/meminfo (or a recorded copy at ``path``). Raises HostError."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read()
    except OSError as err:
        raise HostError(f"cannot read meminfo: {os.strerror(err.errno or 0)}", path=path, errno=err.errno) from err
    try:
        return parse_meminfo(text)
    except ValueError as err:
        raise HostError(f"unreadable meminfo: {err}", path=path) from err


def _pressure_line(words: list[str]) -> PressureLine:
    kv = dict(word.split("=", 1) for word in words)
    return PressureLine(float(kv["avg10"]), float(kv["avg60"]), float(kv["avg300"]), int(kv["total"]))


def parse_pressure(text: str) -> MemoryPressure:
    """Parse PSI text (``some avg10=.. avg60=.. avg300=.. total=..``). Raises ValueError."""
    lines: dict[str, PressureLine] = {}
    for line in text.splitlines():
        words = line.split()
        if words and words[0] in ("some", "full"):
            try:
                lines[words[0]] = _pressure_line(words[1:])
            except (KeyError, ValueError) as err:
                raise ValueError(f"bad PSI line {line!r}") from err
    if "some" not in lines:
        raise ValueError("no 'some' line")
    return MemoryPressure(some=lines["some"], full=lines.get("full"))


def read_pressure(path: str = PRESSURE_PATH) -> MemoryPressure | None:
    """Memory pressure from PSI, or None when this kernel has no PSI (file missing or disabled).

    Raises HostError for other read failures or an unreadable file.
    """
    try:
        with open(path, encoding="ascii") as f:
            text = f.read()
    except OSError as err:
        # ENOENT: no CONFIG_PSI; EOPNOTSUPP: built in but booted with psi=0.
        if err.errno in (_errno.ENOENT, _errno.EOPNOTSUPP):
            return None
        raise HostError(f"cannot read PSI: {os.strerror(err.errno or 0)}", path=path, errno=err.errno) from err
    try:
        return parse_pressure(text)
    except ValueError as err:
        raise HostError(f"unreadable PSI: {err}", path=path) from err
