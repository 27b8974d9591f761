"""Who uses this machine's CPU: every process's CPU time so far, labelled by host and program.

A bench on two cores whose TCG guests are CPU-bound loses guest requests to
whatever else runs; :func:`cpu_ticks` is one sample (utime + stime of every
process, its threads included, in clock ticks), :func:`cpu_seconds` the CPU
seconds each label used between two samples. A label is ``HOST/PROGRAM``:
HOST the container whose pid namespace the process is in ("-" for this
machine's own), PROGRAM what it runs (``qemu``, ``vmcache-agent``,
``delaydev``, else its comm). QEMU and the delay devices also have a
``PROGRAM:waiting`` label: the time their threads were ready to run but
waited for a CPU (schedstat), what slows a guest on a busy host even when
the CPU it used did not change.
"""

from __future__ import annotations

import os
from collections import defaultdict

TICK = os.sysconf("SC_CLK_TCK")


def _program(pid: str, comm: str) -> str:
    if comm.startswith("qemu-system"):
        return "qemu"
    if comm.startswith("kworker"):
        return "kworker"   # its comm names the work it runs now
    if comm.startswith(("python", "vmcache")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            return comm
        if any(b"delaydev" in a for a in argv[:3]):
            return "delaydev"
        for i, a in enumerate(argv[:4]):   # python -I -m vmcache agent: the agent the hook starts
            if a.endswith(b"vmcache") and i + 1 < len(argv):   # .../bin/vmcache SUB or python -m vmcache SUB
                return "vmcache-" + argv[i + 1].decode(errors="replace")
    return comm


def cpu_ticks(namespaces: dict[str, str]) -> dict[int, tuple[str, int]]:
    """pid -> (label, CPU ticks so far) of every process; ``namespaces`` names hosts by pid-namespace link
    (``os.readlink('/proc/LEADER/ns/pid')``)."""
    out: dict[int, tuple[str, int]] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
            ns = os.readlink(f"/proc/{pid}/ns/pid")
        except OSError:
            continue   # gone meanwhile
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        ticks = int(fields[11]) + int(fields[12])   # utime, stime
        label = f"{namespaces.get(ns, '-')}/{_program(pid, comm)}"
        out[int(pid)] = (label, ticks)
        if label.endswith(("/qemu", "/delaydev")):
            out[-int(pid)] = (label + ":waiting", _waited(pid))
    return out


def _waited(pid: str) -> int:
    """Clock ticks the process's threads spent ready to run, waiting for a CPU (schedstat's second field)."""
    waited = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                waited += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue   # a thread gone meanwhile
    return waited * TICK // 1_000_000_000


def cpu_seconds(before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]]) -> dict[str, float]:
    """CPU seconds per label (the later sample's) between two samples: processes in both, and those started
    between them (a pid used again within a sample's time is taken for the same process)."""
    used: dict[str, float] = defaultdict(float)
    for pid, (label, ticks) in after.items():
        old = before.get(pid)
        if old is not None and old[1] > ticks and pid < 0:   # a waiting label: a thread that ended took its share
            continue
        start = old[1] if old is not None and old[1] <= ticks else 0
        used[label] += (ticks - start) / TICK
    return dict(used)
