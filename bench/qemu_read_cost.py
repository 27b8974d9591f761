"""What one dirty-bitmap read costs QEMU: CPU time and peak RSS of a paused qemu-system-x86_64.

A sparse raw image of each SIZE (made in --dir; ext4 files stop at 16 TiB),
a DirtyTracker on its storage node; N reads, each after one 4 KiB guest
write (``busy``) or after none (``idle``). QEMU's utime+stime over the N
reads, per read, and its VmHWM before and after.

    .venv/bin/python -m bench.qemu_read_cost [--sizes 1T,8T] [--reads 20] [--dir /var/tmp]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from tests.qemu_helpers import STORAGE_NODE, QemuVM, image
from vmcache.host.qmp import SocketMonitor
from vmcache.host.tracker import DirtyTracker


def _cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _hwm_mib(pid: int) -> int:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmHWM"))
    return int(line.split()[1]) // 1024


def measure(size: str, reads: int, busy: bool, directory: str) -> str:
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        work = Path(tmp)
        with QemuVM(work, image(work / "disk.raw", "raw", size), "raw") as vm:
            assert vm.proc is not None
            pid = vm.proc.pid
            with SocketMonitor(str(vm.tool_socket)) as monitor, \
                    DirtyTracker(monitor, STORAGE_NODE, runtime_dir=str(work / "run")) as tracker:
                tracker.read()
                hwm, cpu = _hwm_mib(pid), _cpu(pid)
                for i in range(reads):
                    if busy:
                        vm.hmp_write((i * 7919 % 1000) << 30, 4096)
                    tracker.read()
                per = 1000 * (_cpu(pid) - cpu) / reads
                return (f"{size} {'busy' if busy else 'idle'}: QEMU {per:.1f} ms CPU a read"
                        f"{' (with its write)' if busy else ''}, VmHWM {hwm} -> {_hwm_mib(pid)} MiB")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1T,8T")
    p.add_argument("--reads", type=int, default=20)
    p.add_argument("--dir", default="/var/tmp")
    args = p.parse_args()
    for size in args.sizes.split(","):
        for busy in (False, True):
            print(measure(size, args.reads, busy, args.dir), flush=True)


if __name__ == "__main__":
    main()
