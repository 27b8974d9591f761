"""One full engine cycle per disk size: scan + read evidence + model + plan + pin, a fixed touched set.

    .venv/bin/python bench/bench_engine.py [--dir /var/tmp] [--sizes 64G,1T,16T,64T] [--rounds 3] [--cycles 12]

For each size, makes a sparse image of that size, writes 512 MiB of it in 8
ranges of 64 MiB spread over the whole image (so those pages are in the
page cache), and runs DiskEngine cycles at the default ModelParams with a
256 MiB budget and no prefetch limit: the first cycles pin, the later ones
are the steady state. Each size runs in its own process (bench/sizes.py),
rounds interleaved. Per run: the median CPU time (time.process_time) of a
cycle from the 4th on, the worst cycle, and the process's own memory
(RssAnon, peak over the cycles; the locked image pages are file pages, not
in RssAnon). ext4 refuses files of 16 TiB and more: give ``--dir`` on XFS
for the large sizes (docs/benchmarks.md shows a loop-mounted one). tmpfs
takes them but is no place for images, and its cachestat(2) costs ~10x
more than a disk filesystem's. Deletes the image.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.sizes import SIZES, emit, load, run_sizes, status_bytes, table
from vmcache.model.params import ModelParams
from vmcache.service.engine import DiskEngine
from vmcache.service.enginepolicy import EnginePolicy
from vmcache.units import parse_size

MiB, GiB = 1 << 20, 1 << 30


class CpuClock:
    """The engine's clock: monotonic time advanced one interval per cycle (no sleeping)."""

    def __init__(self, interval: float) -> None:
        self.now, self.interval = 0.0, interval

    def __call__(self) -> float:
        self.now += self.interval / 2
        return self.now


def one(size_text: str, directory: str, cycles: int) -> None:
    """Child: the engine's cycles on one sparse image of ``size_text``; emit the figures."""
    params = ModelParams()
    size = parse_size(size_text, key="--one")
    fd, path = tempfile.mkstemp(prefix="vmcache-scale-bench-", suffix=".img", dir=directory)
    try:
        os.ftruncate(fd, size)
        chunk = os.urandom(MiB)
        for k in range(8):
            base = k * (size // 8 // MiB) * MiB + (k % 2) * MiB
            for off in range(0, 64 * MiB, MiB):
                os.pwrite(fd, chunk, base + off)
        os.close(fd)
        fd = -1
        base_anon = status_bytes("RssAnon")
        costs, anon, pinned = [], 0, 0
        with DiskEngine(path, params=params, budget=256 * MiB, policy=EnginePolicy(GiB),
                        clock=CpuClock(params.interval)) as engine:
            for _ in range(cycles):
                started = time.process_time()
                stats = engine.cycle()
                costs.append((time.process_time() - started) * 1e3)
                anon = max(anon, status_bytes("RssAnon"))
                pinned = max(pinned, stats.pinned_bytes)
        steady = costs[3:] or costs
        emit({"cpu_ms": statistics.median(steady), "cpu_max_ms": max(costs), "anon_mib": anon / MiB,
              "base_mib": base_anon / MiB, "pinned_mib": pinned / MiB})
    finally:
        if fd >= 0:
            os.close(fd)
        os.unlink(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--sizes", default=SIZES)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cycles", type=int, default=12)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        one(args.one, args.dir, args.cycles)
        return 0
    print(f"machine: {platform.machine()}, Linux {platform.release()}, Python {platform.python_version()}; "
          f"load before: {load()}")
    print(f"touched: 512 MiB in 8 ranges of 64 MiB, budget 256 MiB, {args.cycles} cycles per run, "
          f"{args.rounds} rounds, images in {args.dir}")
    results = run_sizes(__file__, args.sizes.split(","), args.rounds,
                        ["--dir", args.dir, "--cycles", str(args.cycles)])
    print(table(results, [("cpu_ms", "cycle ms CPU (median from 4th)", ".1f"),
                          ("cpu_max_ms", "worst cycle ms", ".1f"), ("anon_mib", "RssAnon peak MiB", ".0f"),
                          ("base_mib", "RssAnon after imports MiB", ".0f"),
                          ("pinned_mib", "pinned MiB (max)", ".0f")]))
    print(f"load after: {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
