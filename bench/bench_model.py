"""CPU and memory of one model cycle (HeatModel.step_blocks + plan_active) per disk size, a fixed touched set.

Run: .venv/bin/python bench/bench_model.py [--sizes 64G,1T,16T,64T] [--rounds 3] [--cycles 20]

Default ModelParams (1 MiB blocks). Whatever the disk size, the guest
touches the same 512 MiB, spread over the whole disk: 8 hot ranges of 48
blocks resident, 64 scattered blocks partly resident (their fractions change
every cycle), 32 scattered blocks partly written plus one range of 32 blocks
being written; ``ours`` is the set pinned by the previous plan, as the
engine reports it; budget 256 MiB. Each size runs in its own process
(bench/sizes.py), rounds interleaved; per round the median CPU time
(time.process_time) of step + plan over the cycles, and the process's
peak RssAnon over the cycles, beside RssAnon after the imports (the
difference is what the model and its inputs cost).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.sizes import SIZES, emit, load, run_sizes, status_bytes, table
from vmcache.model import HeatModel, ModelParams, Region
from vmcache.model.blocks import BlockValues
from vmcache.model.planner import plan_active
from vmcache.units import format_size, parse_size

BUDGET = 256 << 20


class Touched:
    """The guest's activity: the same 512 blocks whatever ``n``, spread over the disk."""

    def __init__(self, n: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.rng = rng
        starts = (np.arange(8) * (n // 8) + rng.integers(0, max(1, n // 8 - 48), 8)).astype(np.int64)
        self.hot = (starts[:, None] + np.arange(48)).ravel()
        w0 = int(rng.integers(0, n - 32))
        self.wrange = np.arange(w0, w0 + 32, dtype=np.int64)
        # scattered blocks apart from the ranges (each block listed once)
        self.scattered = np.setdiff1d(rng.choice(n, 256, replace=False), self.hot)[:64].astype(np.int64)
        self.wscattered = np.setdiff1d(rng.choice(n, 256, replace=False), self.wrange)[:32].astype(np.int64)

    def residency(self) -> BlockValues:
        """Blocks with resident pages and their fractions (this cycle)."""
        frac = self.rng.integers(1, 257, self.scattered.size).astype(np.float32) / 256
        blocks = np.concatenate((self.hot, self.scattered))
        values = np.concatenate((np.ones(self.hot.size, np.float32), frac))
        order = np.argsort(blocks, kind="stable")
        return BlockValues(blocks[order], values[order])

    def writes(self) -> BlockValues:
        frac = self.rng.integers(1, 17, self.wscattered.size).astype(np.float32) / 16
        blocks = np.concatenate((self.wscattered, self.wrange))
        values = np.concatenate((frac, np.full(self.wrange.size, 0.5, np.float32)))
        order = np.argsort(blocks, kind="stable")
        return BlockValues(blocks[order], values[order])


def one(size_text: str, cycles: int, seed: int) -> None:
    """Child: run the cycles for one disk size, emit the figures."""
    p = ModelParams()
    size = parse_size(size_text, key="--one")
    n = -(-size // p.block_size)
    base = status_bytes("RssAnon")
    touched = Touched(n, seed)
    model = HeatModel(p, n)
    regions: list[Region] = []
    costs, anon = [], 0
    for cycle in range(cycles):
        residency, writes = touched.residency(), touched.writes()
        spans = [np.arange(r.start // p.block_size, -(-r.end // p.block_size)) for r in regions]
        ours = np.unique(np.concatenate(spans)) if spans else np.zeros(0, np.int64)
        t0 = time.process_time()
        active = model.step_blocks(residency, writes, ours, now=cycle * p.interval)
        regions = plan_active(active, params=p, size_bytes=size, budget=BUDGET, current=regions)
        costs.append((time.process_time() - t0) * 1e3)
        anon = max(anon, status_bytes("RssAnon"))
    emit({"blocks": n, "cpu_ms": statistics.median(costs), "cpu_max_ms": max(costs),
          "anon_mib": anon / 2**20, "base_mib": base / 2**20,
          "regions": len(regions), "pinned_mib": sum(r.length for r in regions) / 2**20})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=SIZES)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        one(args.one, args.cycles, args.seed)
        return
    print(f"machine: {platform.machine()}, Linux {platform.release()}, Python {platform.python_version()}, "
          f"numpy {np.__version__}; load before: {load()}")
    print(f"touched: 512 blocks of {format_size(ModelParams().block_size)}, budget {format_size(BUDGET)}, "
          f"{args.cycles} cycles per run, {args.rounds} rounds")
    results = run_sizes(__file__, args.sizes.split(","), args.rounds,
                        ["--cycles", str(args.cycles), "--seed", str(args.seed)])
    print(table(results, [("blocks", "blocks", ".0f"), ("cpu_ms", "step+plan ms CPU (median)", ".2f"),
                          ("cpu_max_ms", "worst cycle ms", ".1f"), ("anon_mib", "RssAnon peak MiB", ".0f"),
                          ("base_mib", "RssAnon after imports MiB", ".0f"),
                          ("pinned_mib", "planned MiB", ".0f")]))
    print(f"load after: {load()}")


if __name__ == "__main__":
    main()
