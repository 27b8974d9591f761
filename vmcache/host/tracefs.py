"""Tracepoints' perf event ids and record layouts, from tracefs.

A BPF program on a tracepoint reads the kernel's record of the event at
the offsets its ``format`` file gives, and is attached by the event's id
(perf_event_open's config). Both come from tracefs. Many hosts mount it
at /sys/kernel/tracing; where nothing is mounted (this project's test
machine, a minimal Debian), the files are read in a short-lived child in
a private mount namespace (``unshare --mount``), so the host's mounts are
left as they were.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from typing import NamedTuple

from ..errors import HostError

__all__ = ["Field", "Tracepoint", "read_tracepoints", "parse_formats"]

MOUNTED = ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")
PRIVATE_MOUNT = "/sys/kernel/tracing"


class Field(NamedTuple):
    offset: int
    size: int


@dataclass(frozen=True)
class Tracepoint:
    """One tracepoint: ``group/name``, its perf event id and its record's fields by name."""

    group: str
    name: str
    id: int
    fields: dict[str, Field]


def parse_formats(text: str) -> dict[str, Tracepoint]:
    """Tracepoints by name from the concatenated text of their ``format`` files (``group`` left empty)."""
    out: dict[str, Tracepoint] = {}
    name, ident, fields = "", -1, dict[str, Field]()
    for line in [*text.splitlines(), "name: "]:
        line = line.strip()
        if line.startswith("name:"):
            if name and ident >= 0:
                out[name] = Tracepoint("", name, ident, fields)
            name, ident, fields = line.split(":", 1)[1].strip(), -1, {}
        elif line.startswith("ID:"):
            ident = int(line.split(":", 1)[1])
        elif line.startswith("field:"):
            parts = {k.strip(): v.strip() for k, v in (p.split(":", 1) for p in line.split(";") if ":" in p)}
            field = parts["field"].split()[-1].split("[")[0]
            fields[field] = Field(int(parts["offset"]), int(parts["size"]))
    return out


def read_tracepoints(events: list[tuple[str, str]], *, roots: tuple[str, ...] = MOUNTED) -> dict[str, Tracepoint]:
    """The tracepoints ``events`` (group, name) by name; only those this kernel has.

    Raises HostError when tracefs can be neither found nor mounted privately.
    """
    paths = [f"events/{group}/{name}/format" for group, name in events]
    for root in roots:
        if os.path.isdir(os.path.join(root, "events")):
            text = ""
            for path in paths:
                try:
                    with open(os.path.join(root, path), encoding="utf-8") as f:
                        text += f.read()
                except FileNotFoundError:
                    continue
                except OSError as err:
                    raise HostError(f"cannot read tracefs: {err.strerror}", path=root, errno=err.errno) from err
            return _grouped(parse_formats(text), events)
    return _grouped(parse_formats(_private_read(paths)), events)


def _private_read(paths: list[str]) -> str:
    """The files ``paths`` under a tracefs mounted in a private mount namespace of a child process."""
    files = " ".join(f"{PRIVATE_MOUNT}/{p}" for p in paths)
    script = f"mount -t tracefs nodev {PRIVATE_MOUNT} || exit 3; cat {files} 2>/dev/null; exit 0"
    try:
        done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                              capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise HostError(f"cannot mount tracefs privately: {err}") from err
    if done.returncode != 0:  # a kernel without any of the events answers nothing, and that is no error
        raise HostError(f"cannot mount tracefs privately: {done.stderr.strip() or f'exit status {done.returncode}'}")
    return done.stdout


def _grouped(found: dict[str, Tracepoint], events: list[tuple[str, str]]) -> dict[str, Tracepoint]:
    groups = dict((name, group) for group, name in events)
    return {name: Tracepoint(groups[name], name, tp.id, tp.fields) for name, tp in found.items() if name in groups}
