"""What counting guest reads in the kernel costs every other read on the host (issues 20 and 40).

    .venv/bin/python bench/readcount_cost.py [--rounds 3] [--runtime 6] [--file /var/tmp/rd-cost.bin]

fio 4 KiB random reads (psync, one job as a thread) of a cached 64 MiB
file, one run per arm in each round, the arms' order rotated from round
to round (bench/order.py):

- ``off``: no read-counting program loaded;
- ``tracepoint``: the tracepoint set (``mm_filemap_get_pages`` and its
  companions), as 100 agents use it (100 QEMU pids and 100 images
  registered), fio not among them: what every host read pays (where an
  agent runs already, its set is joined: ``off`` is not "no program"
  then, and the line "programs loaded before" says so);
- ``probe``: the same with the ``filemap_read`` probe (fentry/fexit);
- ``counted``: the tracepoint set with fio itself registered as a QEMU and
  its file watched: what a guest's own reads pay to be counted (fio starts
  reading 2 s after it starts, once registered; every arm waits the same).

An arm this kernel refuses is reported as such and left out. Prints IOPS
per arm and round, the medians, each arm's ratio to ``off`` (median,
min-max over rounds) and the load average before and after. Run as root,
alone on the machine (``flock -x /run/lock/vmcache-quiet.lock``). Leaves
nothing: every program and map is this process's and goes with it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.order import round_order
from vmcache.host import bpf
from vmcache.host.readcount import FileReads, ReadCounter, ReadCountError
from vmcache.host.readsets import ORDER, ProbeSet, ReadSet, TracepointSet

MiB = 1 << 20
ARMS: dict[str, tuple[type[ReadSet], ...]] = {"off": (), "tracepoint": (TracepointSet,), "probe": (ProbeSet,),
                                              "counted": (TracepointSet,)}


def fio(path: str, runtime: int, registered: Callable[[int], object] | None = None) -> float:
    """fio's IOPS; ``registered`` is called with fio's pid before it reads (its jobs are threads of it)."""
    cmd = ["fio", "--name=r", f"--filename={path}", "--rw=randread", "--bs=4k", "--size=64M", "--thread",
           "--ioengine=psync", "--time_based", f"--runtime={runtime}", "--startdelay=2", "--output-format=json",
           "--invalidate=0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        if registered is not None:
            registered(proc.pid)
        out, _ = proc.communicate(timeout=runtime + 60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode:
        raise RuntimeError(f"fio failed ({proc.returncode})")
    return float(json.loads(out)["jobs"][0]["read"]["iops"])


class Agents:
    """100 agents' worth of counters of the set ``order`` names (QEMU pids of no process), an image each."""

    def __init__(self, order: tuple[type[ReadSet], ...], images: list[str]) -> None:
        """Raises ReadCountError (nothing is left registered)."""
        self.counters: list[ReadCounter] = []
        self.watched: list[FileReads] = []
        self.order = order
        self.lock_dir = tempfile.mkdtemp(prefix="rd-cost-")
        try:
            for i, image in enumerate(images):
                self.count(4_000_000 + i, image)
        except BaseException:
            self.close()
            raise

    def count(self, pid: int, path: str) -> None:
        """Count ``pid``'s reads of ``path`` as a QEMU's of its image. Raises ReadCountError."""
        self.counters.append(ReadCounter.open(pid, lock_dir=self.lock_dir, order=self.order))
        self.watched.append(self.counters[-1].watch(path, MiB))

    def close(self) -> None:
        """Unregister every image and QEMU (from another agent's set too, where they joined one)."""
        for w in self.watched:
            w.close()
        for c in self.counters:
            c.close()
        shutil.rmtree(self.lock_dir, ignore_errors=True)


def loaded() -> int:
    names = bpf.program_names()
    return sum(names.count(kind.NAME) for kind in ORDER)


def main() -> int:
    # 100 agents' counters in one process: each holds descriptors of the set's links and maps and two count
    # maps per image (~1,100 in all), past the usual soft limit of 1,024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--runtime", type=int, default=6)
    p.add_argument("--file", default="/var/tmp/rd-cost.bin")
    args = p.parse_args()
    with open(args.file, "wb") as f:
        f.write(os.urandom(64 * MiB))
    images = []
    for i in range(100):
        path = f"{args.file}.{i}"
        Path(path).write_bytes(b"\0" * 4096)
        images.append(path)
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} kernel {os.uname().release}, load average {os.getloadavg()}, "
          f"read-counting programs loaded before: {loaded()}", flush=True)
    results: dict[str, list[float]] = {}
    refused: dict[str, str] = {}
    try:
        for rnd in range(args.rounds):
            for arm in round_order(list(ARMS), rnd + 1):
                if arm in refused:
                    continue
                try:
                    agents = Agents(ARMS[arm], images) if ARMS[arm] else None
                except ReadCountError as err:
                    refused[arm] = str(err)
                    print(f"round {rnd + 1} {arm:10s} refused: {err}", flush=True)
                    continue
                try:
                    counting = agents if arm == "counted" else None   # fio's own reads counted
                    iops = fio(args.file, args.runtime,
                               None if counting is None else lambda pid: counting.count(pid, args.file))
                    if counting is not None:   # the arm counted fio's reads, or it measured nothing
                        pages = float(counting.watched[-1].take(64).pages.value.sum())
                        print(f"round {rnd + 1} {arm:10s} counted {pages:,.0f} pages read by fio", flush=True)
                finally:
                    if agents is not None:
                        agents.close()
                results.setdefault(arm, []).append(iops)
                print(f"round {rnd + 1} {arm:10s} {iops:10.0f} IOPS", flush=True)
    finally:
        for path in [args.file, *images]:
            os.unlink(path)
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} load average {os.getloadavg()}")
    base = results["off"]
    for arm, values in results.items():
        ratios = [v / b for v, b in zip(values, base)]
        print(f"{arm:10s} IOPS {' / '.join(f'{v:,.0f}' for v in values)}  median {statistics.median(values):10,.0f}"
              f"  ratio to off {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")
    for arm, reason in refused.items():
        print(f"{arm:10s} refused by this kernel: {reason}")
    print("programs left:", loaded())
    return 0


if __name__ == "__main__":
    sys.exit(main())
