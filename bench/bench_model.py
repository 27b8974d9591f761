"""CPU and memory cost of one model cycle (HeatModel.step + plan) for a 1 TiB image.

Run: .venv/bin/python bench/bench_model.py [--cycles N] [--size 1T] [--budget 4G]

Default ModelParams (1 MiB blocks: 1,048,576 blocks). Inputs imitate a busy
guest: 40 hot ranges (64 MiB - 1 GiB) resident, 60,000 scattered blocks
partly resident (changing every cycle), 5,000 scattered written blocks plus
two ranges being written; ``ours`` is the set pinned by the previous plan,
as the engine would report it. Times are CPU time (time.process_time) of
the model step and the plan, per cycle; cycles where ``ours`` changed (the
model recomputes its cached normalisation) are reported apart. Peak RSS is
the whole process's (ru_maxrss), imports included.
"""

from __future__ import annotations

import argparse
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import scipy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vmcache.model import HeatModel, ModelParams, Region, plan  # noqa: E402
from vmcache.units import format_size, parse_size  # noqa: E402


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def p90(values: list[float]) -> float:
    return sorted(values)[int(0.9 * (len(values) - 1))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=40)
    ap.add_argument("--size", default="1T")
    ap.add_argument("--budget", default="4G")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    p = ModelParams()
    size = parse_size(args.size, key="--size")
    budget = parse_size(args.budget, key="--budget")
    n = -(-size // p.block_size)
    rng = np.random.default_rng(args.seed)

    hot = np.zeros(n, dtype=bool)
    for _ in range(40):
        length = int(rng.integers(64, 1024))  # blocks of 1 MiB
        start = int(rng.integers(0, n - length))
        hot[start : start + length] = True
    write_ranges = [(int(s), int(s) + 200) for s in rng.integers(0, n - 200, 2)]

    model = HeatModel(p, n)
    residency = np.zeros(n, dtype=np.float32)
    writes = np.zeros(n, dtype=np.float32)
    ours = np.zeros(n, dtype=bool)
    regions: list[Region] = []
    step_t: list[float] = []
    plan_t: list[float] = []
    changed: list[bool] = []
    previous = ours.copy()

    for cycle in range(args.cycles):
        # --- inputs (not timed)
        residency.fill(0.0)
        residency[hot] = 1.0
        scattered = rng.integers(0, n, 60_000)
        residency[scattered] = rng.integers(1, 257, scattered.size).astype(np.float32) / 256
        writes.fill(0.0)
        writes[rng.integers(0, n, 5_000)] = rng.integers(1, 17, 5_000).astype(np.float32) / 16
        for s, e in write_ranges:
            writes[s:e] = 0.5
        ours.fill(False)
        for r in regions:
            ours[r.start // p.block_size : -(-r.end // p.block_size)] = True
        changed.append(not np.array_equal(ours, previous))
        previous = ours.copy()

        # --- timed: one cycle of the model
        t0 = time.process_time()
        heat = model.step(residency, writes, ours, now=cycle * p.interval)
        t1 = time.process_time()
        regions = plan(heat, params=p, size_bytes=size, budget=budget, current=regions, own=model.own)
        t2 = time.process_time()
        step_t.append((t1 - t0) * 1e3)
        plan_t.append((t2 - t1) * 1e3)

    total = [a + b for a, b in zip(step_t, plan_t)]
    steady = [t for t, c in zip(total, changed) if not c]
    moved = [t for t, c in zip(total, changed) if c]
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    print(f"machine: {cpu_model()}, {platform.machine()}, Linux {platform.release()}, "
          f"Python {platform.python_version()}, numpy {np.__version__}, scipy {scipy.__version__}")
    print(f"image {format_size(size)}, {n} blocks of {format_size(p.block_size)}, budget {format_size(budget)}, "
          f"{args.cycles} cycles")
    print(f"last plan: {len(regions)} regions, {format_size(sum(r.length for r in regions))} pinned")
    print(f"model step  CPU ms: median {statistics.median(step_t):.1f}  max {max(step_t):.1f}")
    print(f"plan        CPU ms: median {statistics.median(plan_t):.1f}  max {max(plan_t):.1f}")
    print(f"step+plan   CPU ms: median {statistics.median(total):.1f}  p90 {p90(total):.1f}  "
          f"max {max(total):.1f}  (first cycle {total[0]:.1f}, buffers faulted in)")
    if steady:
        print(f"  cycles with ours unchanged ({len(steady)}): median {statistics.median(steady):.1f}")
    if moved:
        print(f"  cycles with ours changed   ({len(moved)}): median {statistics.median(moved):.1f}")
    print(f"peak RSS: {rss_kib / 1024:.1f} MiB")


if __name__ == "__main__":
    main()
