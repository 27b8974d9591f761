"""What B's agent loaded after a migration: the device reads inside its new pins, before each was pinned.

Pure: unit tested in tests/unit/test_bench_migrate.py. The delay device of
B's mount logs every read it serves (migrate.sh with
``VMCACHE_MIGRATE_LOG_READS=1``: unix time, file, offset, bytes; flushed
every 0.5 s); B's agent
logs ``pin.add start=S length=N`` once a new region is read in and locked.
A read of the image on B after the switch counts as the agent's load for
the bytes of it inside a region pinned at or after the read's time: the
pinner asks for a region's missing pages (``POSIX_FADV_WILLNEED``), locks
it, then logs. A guest's miss inside such a region before its pin is
counted too; at a few hundred 4 KiB misses a second against a set of
hundreds of MiB read in seconds, that is small, and it is said where the
figure is printed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from bench.device_reads import PinAdd as Pin
from bench.device_reads import Read

_PIN = re.compile(r"\bpin\.add start=(\d+) length=(\d+)")


def parse_pins(lines: Iterable[tuple[float, str]]) -> list[Pin]:
    """The ``pin.add`` events of an agent's journal lines ((time, message))."""
    return [Pin(t, int(m.group(1)), int(m.group(2))) for t, text in lines if (m := _PIN.search(text))]


def loaded_bytes(reads: Iterable[Read], pins: list[Pin], image: str, since: float, until: float) -> int:
    """Bytes of ``image`` read in ``[since, until]`` inside a region of ``pins`` pinned at or after the read
    (a byte inside two such regions, one replacing the other, counts once)."""
    total = 0
    for r in reads:
        if r.file != image or not since <= r.time <= until:
            continue
        parts = sorted((max(r.offset, p.start), min(r.offset + r.length, p.start + p.length))
                       for p in pins if p.time >= r.time)
        end = r.offset
        for lo, hi in parts:
            lo = max(lo, end)
            if hi > lo:
                total += hi - lo
                end = hi
    return total


def value_of(message: str, key: str) -> str | None:
    """The value of ``key=`` in an agent's log line (``event key=value ...``); None without one."""
    m = re.search(rf"(?:^|\s){re.escape(key)}=(\S+)", message)
    return m.group(1) if m else None
