"""Where an e2e run's device reads came from: the agent's pin loads, the guest's misses, readahead.

    .venv/bin/python bench/device_reads.py .bench/e2e-<time>/r1/<arm> [...]

Needs a run made with ``bench/e2e.py --log-device-reads``: the delay device
then logs every read it served (``device-reads.log``: unix time, file,
offset, bytes), the run's ``result.json`` has the measured window's wall
times and the agent's log of the run is beside them. Each 4 KiB page read
from the device in the measured window is put in one class:

- ``agent load``: inside a region the agent pinned, in the seconds before
  its ``pin.add`` (the pinner reads a new region's missing pages in 1 MiB
  preads, then mlocks it and logs the event);
- ``guest 4k hot`` / ``guest 4k cold``: single-page requests, in the hot
  range (the first 10% of the image) or not: the guest's own misses
  (QEMU reads 4 KiB; ``POSIX_FADV_RANDOM`` is not set on its file, but a
  random miss reads one page);
- ``other``: larger requests that are not agent loads (the kernel's
  readahead around a guest miss).

Pages per guest read are printed beside each class.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

PAGE = 4096
LOAD_WINDOW = 5.0    # seconds before a pin.add in which reads of its region count as its load
_PIN = re.compile(r"^(\S+ \S+) INFO .* pin\.add start=(\d+) length=(\d+)")


@dataclass(frozen=True)
class PinAdd:
    time: float
    start: int
    length: int


@dataclass(frozen=True)
class Read:
    """One read the delay device served (its ``--log-reads`` line)."""

    time: float
    file: str
    offset: int
    length: int


def parse_reads(text: str) -> list[Read]:
    """The delay device's read log (``unix_time file offset bytes`` lines; a torn last line is left out)."""
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[2].isdigit() and parts[3].isdigit():
            out.append(Read(float(parts[0]), parts[1], int(parts[2]), int(parts[3])))
    return out


def pin_adds(log_text: str) -> list[PinAdd]:
    """The ``pin.add`` events of an agent log (local-time timestamps, as the agent's logging writes them)."""
    out = []
    for line in log_text.splitlines():
        m = _PIN.match(line)
        if m:
            t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out.append(PinAdd(t, int(m.group(2)), int(m.group(3))))
    return out


def classify(reads: list[tuple[float, int, int]], pins: list[PinAdd], window: tuple[float, float],
             hot_end: int) -> dict[str, int]:
    """Pages of ``reads`` (time, offset, bytes) in ``window``, by class (see the module's docstring)."""
    out = {"agent load": 0, "guest 4k hot": 0, "guest 4k cold": 0, "other": 0}
    for t, off, n in reads:
        if not window[0] <= t <= window[1]:
            continue
        pages = max(1, n // PAGE)
        if any(p.time - LOAD_WINDOW <= t <= p.time and p.start <= off < p.start + p.length for p in pins):
            out["agent load"] += pages
        elif n <= PAGE:
            out["guest 4k hot" if off < hot_end else "guest 4k cold"] += pages
        else:
            out["other"] += pages
    return out


def report(arm_dir: Path) -> str:
    res = json.loads((arm_dir / "result.json").read_text())
    window = (res["load"]["start_unix"], res["load"]["end_unix"])
    reads = [(r.time, r.offset, r.length) for r in parse_reads((arm_dir / "device-reads.log").read_text())]
    pins = [p for log in arm_dir.glob("agent-*.log") for p in pin_adds(log.read_text())]
    guest_reads = sum(j["read"]["total_ios"] for j in res["fio"])
    hot_end = (2 << 30) // 10 // PAGE * PAGE   # the bench's hot range: the first 10% of the 2 GiB image
    classes = classify(reads, pins, window, hot_end)
    total = sum(classes.values())
    parts = ", ".join(f"{k} {v} ({v / guest_reads:.2f})" for k, v in classes.items())
    return (f"{arm_dir.name}: {guest_reads} guest reads, {total} device pages ({total / guest_reads:.2f} a read) "
            f"in the measured window; {parts}; {len(pins)} pin.add")


def main() -> int:
    for d in sys.argv[1:]:
        print(report(Path(d)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
