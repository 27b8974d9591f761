"""CPU cost of dividing the host cap by benefit for N VMs, per agent cycle.

Run: .venv/bin/python bench/bench_share.py [--vms 100] [--rounds 200]

What one agent does each cycle for the split (service/budget.py ->
host/ledger.py Ledger.divide): under the flock, read ledger.json and
share.json holding N domains (each a full 32-point demand curve), split the
cap (model/share.split), write both files back. Measured two ways, CPU time
(time.process_time), median and spread over ``--rounds``:

- ``split``: the pure water-filling alone, N demands of 32 points;
- ``divide``: the whole Ledger.divide with N-1 other live entries on disk
  (a temporary directory; liveness checks answered True, not read from
  /proc, so the figure is vmcache's own work). Before every timed call
  every other entry's curve is changed (outside the timing), as when all
  other agents republished since this one's last cycle: no cached check
  helps, the worst case.

Also the demand curve of one disk (model/share.demand_of on a HeatModel's
sparse heat with 1024 hot runs), which each agent computes once per disk
per cycle.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vmcache.host.ledger import Ledger
from vmcache.model.heat import ActiveHeat
from vmcache.model.params import ModelParams
from vmcache.model.share import MAX_POINTS, Demand, demand_of, split

MiB = 1 << 20


def curve(seed: int) -> tuple[tuple[int, float], ...]:
    """A 32-point concave curve of up to 2 GiB with densities falling from ~1 (seeded)."""
    rng = np.random.default_rng(seed)
    steps = np.sort(rng.random(MAX_POINTS))[::-1]
    sizes = rng.integers(1, 64, MAX_POINTS) * MiB
    return tuple((int(b), float(v)) for b, v in zip(np.cumsum(sizes), np.cumsum(steps * sizes)))


def timed(fn, rounds: int) -> list[float]:  # type: ignore[no-untyped-def]
    out = []
    for _ in range(rounds):
        t = time.process_time()
        fn()
        out.append((time.process_time() - t) * 1000)
    return out


def show(name: str, ms: list[float]) -> None:
    q = statistics.quantiles(ms, n=20)
    print(f"{name:28s} median {statistics.median(ms):7.3f} ms  p5 {q[0]:7.3f}  p95 {q[-1]:7.3f}  (n={len(ms)})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vms", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    n, cap = args.vms, 64 << 30
    demands = {f"vm{i:03d}": Demand(budget=2 << 30, minimum=(64 * MiB if i % 10 == 0 else 0), curve=curve(i),
                                    granted=cap // n) for i in range(n)}
    show(f"split, {n} VMs", timed(lambda: split(demands, cap, quantum=cap // 100), args.rounds))

    with tempfile.TemporaryDirectory(prefix="vmcache-share-bench-") as tmp:
        path = os.path.join(tmp, "ledger.json")
        for i, (name, d) in enumerate(demands.items()):
            if i:  # the others, each with its own (fake, live) pid
                Ledger(path, cap, pid=100000 + i, alive=lambda _p, _s: True).divide(name, d)
        me = Ledger(path, cap, pid=100000, alive=lambda _p, _s: True)
        mine = demands["vm000"]
        me.divide("vm000", mine)
        share_path = os.path.join(tmp, "share.json")
        ms = []
        for k in range(args.rounds):
            data = json.loads(Path(share_path).read_text())
            for name, item in data["domains"].items():
                if name != "vm000":
                    item["demand"] = [[b, v + k + 1] for b, v in item["demand"]]
            Path(share_path).write_text(json.dumps(data))
            ms += timed(lambda: me.divide("vm000", mine, held=cap // n), 1)
        show(f"Ledger.divide, {n} VMs", ms)
        size = os.path.getsize(os.path.join(tmp, "share.json"))
        print(f"share.json with {n} VMs: {size} bytes")

    params = ModelParams()
    rng = np.random.default_rng(1)
    starts = np.sort(rng.choice(1 << 20, 1024, replace=False)) // 8 * 8
    blocks = np.unique((starts[:, None] + np.arange(6)[None, :]).ravel()).astype(np.int64)
    heat = rng.random(blocks.size).astype(np.float32) + 0.3
    active = ActiveHeat(blocks, heat, heat)
    show("demand_of, 1 disk (1 TiB)", timed(lambda: demand_of(active, params, size_bytes=1 << 40, budget=4 << 30),
                                             args.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
