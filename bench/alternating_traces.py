"""Two VMs busy in turn, as block traces for the replay's host mode (docs/benchmarks.md, the alternating pair).

What `--set peers`' `alternate` arms run in their guests, as traces: each
VM runs fio's ``zoned:90/10:10/90`` (guest/init) - 90% of the requests in
the first 10% of its 2 GiB disk, the rest over the other 90%; 20% writes,
4 KiB - at ``--rate`` requests a second for ``--phase`` seconds, then idles
as long while the other one runs; ``--turns`` turns in all, the first VM
first. Every busy turn reads the same zone, as fio's does. Seeded: the same
files every run.

    .venv/bin/python -m bench.alternating_traces OUT_DIR      # OUT_DIR/vm1.csv, OUT_DIR/vm2.csv
    vmcache replay --vm OUT_DIR/vm1.csv,budget=256M,size=2G --vm OUT_DIR/vm2.csv,budget=256M,size=2G \\
        --cap 224M --memory 320M --block-size 1M
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from vmcache.replay.generate import requests
from vmcache.replay.trace import Trace, write_csv

GiB = 1 << 30


def alternating(vm: int, *, phase: float, turns: int, rate: float, size: int = 2 * GiB) -> Trace:
    """VM ``vm`` (0 or 1): busy in turns ``vm``, ``vm + 2``, ... of ``phase`` seconds each."""
    parts = [(k, fio_zoned(size, int(phase * rate), seed=100 * vm + k, rate=rate)) for k in range(vm, turns, 2)]
    return Trace(np.concatenate([t.time + k * phase for k, t in parts]), np.concatenate([t.write for _, t in parts]),
                 np.concatenate([t.offset for _, t in parts]), np.concatenate([t.length for _, t in parts]))


def fio_zoned(size: int, count: int, *, seed: int, rate: float, io_size: int = 4096, hot_space: float = 0.1,
              hot_share: float = 0.9, write_fraction: float = 0.2) -> Trace:
    """fio's ``zoned:90/10:10/90``: ``hot_share`` of the requests in the disk's first ``hot_space``, the rest after."""
    rng = np.random.default_rng(seed)
    units = size // io_size
    zone = int(units * hot_space)
    hot = rng.random(count) < hot_share
    where = np.where(hot, rng.integers(0, zone, size=count), rng.integers(zone, units, size=count))
    return requests(rng, where, count, rate, io_size, write_fraction)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory for vm1.csv and vm2.csv")
    parser.add_argument("--phase", type=float, default=60.0, help="seconds a turn lasts (default 60)")
    parser.add_argument("--turns", type=int, default=8, help="turns in all (default 8)")
    parser.add_argument("--rate", type=float, default=1000.0, help="requests a second while busy (default 1000)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for vm in (0, 1):
        write_csv(alternating(vm, phase=args.phase, turns=args.turns, rate=args.rate), args.out / f"vm{vm + 1}.csv")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
