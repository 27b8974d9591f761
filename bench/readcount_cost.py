"""What counting guest reads in the kernel costs every other read on the host (issue 20).

    .venv/bin/python bench/readcount_cost.py [--rounds 3] [--runtime 8] [--file /var/tmp/rd-cost.bin]

fio 4 KiB random reads (psync, one job as a thread) of a cached 64 MiB
file, arms interleaved, their order rotated from round to round
(bench/order.py):

- ``off``: no read-counting program loaded;
- ``shared``: vmcache's programs loaded, as 100 agents use them (100
  QEMU pids and 100 images registered), fio not among them: what every
  host read pays;
- ``counted``: the same with fio registered as a QEMU and its file
  watched: what each read of a managed image pays (its pages counted);
- ``per-agent``: 64 programs attached to ``mm_filemap_get_pages`` that only
  compare the pid, as one program per agent would for 64 agents (a
  tracepoint takes at most 64; the 65th attachment is tried and fails).

Prints IOPS per arm and round, the medians and each arm's ratio to
``off`` (median, min-max over rounds). Run as root under the team lock.
Leaves nothing: every program and map is this process's and goes with it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.order import round_order
from vmcache.host import bpf
from vmcache.host.readcount import ReadCounter
from vmcache.host.tracefs import read_tracepoints

MiB = 1 << 20
ARMS = ("off", "shared", "counted", "per-agent")


def fio(path: str, runtime: int, register: bool = False) -> float:
    cmd = ["fio", "--name=r", f"--filename={path}", "--rw=randread", "--bs=4k", "--size=64M", "--thread",
           "--ioengine=psync", "--time_based", f"--runtime={runtime}", "--output-format=json", "--invalidate=0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    counter = None
    if register:
        counter = ReadCounter.open(proc.pid, lock_dir=tempfile.gettempdir())
        watched = counter.watch(path, MiB)
    out, _ = proc.communicate()
    if counter is not None:
        got = watched.take(64)
        print(f"  counted {int(got.pages.value.sum())} pages of fio's reads", flush=True)
        watched.close()
        counter.close()
    return float(json.loads(out)["jobs"][0]["read"]["iops"])


def per_agent(n: int) -> list[int]:
    """``n`` programs that compare the pid with one no process has, attached; their fds."""
    point = read_tracepoints([("filemap", "mm_filemap_get_pages")])["mm_filemap_get_pages"]
    a = bpf.Asm()
    a.call(bpf.PID_TGID)
    a.alu("rsh", 0, 32)
    a.jump("ne", 0, 0x7FFFFFFF, "out")
    a.label("out")
    a.mov(0, 0)
    a.exit()
    code, fds = a.assemble(), []
    try:
        for i in range(n):
            fds.append(bpf.load_tracepoint_program(code, name="rd_bench_agent"))
            try:
                fds.append(bpf.attach_tracepoint(fds[-1], point.id))
            except bpf.BpfError as err:
                raise bpf.BpfError(f"attachment {i + 1} of {n}: {err}", errno=err.errno) from err
    except BaseException:
        for fd in fds:  # none may stay attached: the next arm's programs would not fit
            os.close(fd)
        raise
    return fds


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--runtime", type=int, default=8)
    p.add_argument("--file", default="/var/tmp/rd-cost.bin")
    args = p.parse_args()
    with open(args.file, "wb") as f:
        f.write(os.urandom(64 * MiB))
    images = []
    for i in range(100):
        path = f"{args.file}.{i}"
        Path(path).write_bytes(b"\0" * 4096)
        images.append(path)
    try:
        fds = per_agent(65)
    except bpf.BpfError as err:
        print(f"65 programs on one tracepoint: {err}")
    else:
        for fd in fds:
            os.close(fd)
        print("65 programs attached on one tracepoint")
    print(f"load average {os.getloadavg()}, {time.strftime('%Y-%m-%d %H:%M:%S')}", flush=True)
    results: dict[str, list[float]] = {}
    try:
        for rnd in range(args.rounds):
            for arm in round_order(ARMS, rnd + 1):
                held: list[int] = []
                counters: list[ReadCounter] = []
                if arm in ("shared", "counted"):
                    for i in range(100):  # 100 agents: a QEMU and an image each (pids of no process)
                        counters.append(ReadCounter.open(4_000_000 + i, lock_dir=tempfile.gettempdir()))
                        counters[-1].watch(images[i], MiB)
                elif arm == "per-agent":
                    held = per_agent(64)
                iops = fio(args.file, args.runtime, register=arm == "counted")
                for fd in held:
                    os.close(fd)
                for c in counters:
                    c.close()
                results.setdefault(arm, []).append(iops)
                print(f"round {rnd + 1} {arm:10s} {iops:10.0f} IOPS", flush=True)
    finally:
        for path in [args.file, *images]:
            os.unlink(path)
    print(f"load average {os.getloadavg()}, {time.strftime('%Y-%m-%d %H:%M:%S')}")
    base = results["off"]
    for arm, values in results.items():
        ratios = [v / b for v, b in zip(values, base)]
        print(f"{arm:10s} median {statistics.median(values):10.0f} IOPS  ratio to off {statistics.median(ratios):.3f}"
              f" ({min(ratios):.3f}-{max(ratios):.3f})")
    print("programs left:", bpf.program_names().count("vmcache_reads1"), bpf.program_names().count("rd_bench_agent"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
