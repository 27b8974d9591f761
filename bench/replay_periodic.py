"""The e2e bench's periodic hot set, replayed off-line: does the plan keep the hot range through the off phases?

The guest of ``scripts/bench.sh --arms periodic-ssd-*`` reads the first 10%
of a 2 GiB image in 30 s phases and the rest of the image between them;
the agent may pin 256 MiB of a 512 MiB cache. This builds that trace and
runs it through ``vmcache.replay.sim.vmcache`` (the agent's cycle on a
simulated cache, no device, no neighbour), printing, per model decay and
seed, how much of the hot range is pinned at the end of each cycle, and
the lowest such value during the off phases.

    .venv/bin/python -m bench.replay_periodic [--decay 0.7,0.9] [--seeds 1,2,3] [--rate 1500] [--gap 60]

Deterministic; a few seconds a run.
"""

from __future__ import annotations

import argparse

import numpy as np

from vmcache.model.params import ModelParams
from vmcache.replay import sim
from vmcache.replay.accesses import to_blocks
from vmcache.replay.trace import Trace

MiB = 1 << 20
DISK, IO, CACHE, BUDGET, HOT_PHASE = 2048 * MiB, 4096, 512 * MiB, 256 * MiB, 30.0


def periodic_trace(seed: int, rate: float, gap: float, phases: int = 4) -> Trace:
    """Hot, off, hot, ... (``phases`` hot phases): uniform reads in the hot range, then in the rest; 20% writes."""
    rng = np.random.default_rng(seed)
    hot_units, units = (DISK // 10) // IO, DISK // IO
    times, offsets, t = [], [], 0.0
    for i in range(2 * phases - 1):
        hot, length = i % 2 == 0, HOT_PHASE if i % 2 == 0 else gap
        count = int(length * rate)
        times.append(t + np.arange(count) / rate)
        offsets.append(rng.integers(0, hot_units, count) if hot else rng.integers(hot_units, units, count))
        t += length
    time, unit = np.concatenate(times), np.concatenate(offsets)
    return Trace(time, rng.random(len(time)) < 0.2, unit * IO, np.full(len(time), IO))


def hot_range_pinned(decay: float, seed: int, rate: float, gap: float) -> list[tuple[float, int]]:
    """(trace time, MiB of the hot range pinned) after every cycle."""
    params = ModelParams.from_mapping({"decay": decay})
    hot_blocks = (DISK // 10) // params.block_size
    out: list[tuple[float, int]] = []
    sim.vmcache(to_blocks(periodic_trace(seed, rate, gap), IO, DISK), CACHE // IO, params=params,
                pin_budget=BUDGET, size_bytes=DISK, exact=False, rest="lru",
                on_cycle=lambda now, pinned: out.append((now, int((pinned < hot_blocks).sum()) * params.block_size // MiB)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--decay", default="0.7,0.9")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--rate", type=float, default=1500.0, help="guest requests per second (default 1500)")
    p.add_argument("--gap", type=float, default=60.0, help="seconds between hot phases (default 60)")
    args = p.parse_args()
    period = HOT_PHASE + args.gap
    for decay in (float(d) for d in args.decay.split(",")):
        for seed in (int(s) for s in args.seeds.split(",")):
            rows = hot_range_pinned(decay, seed, args.rate, args.gap)
            # the state a hot phase starts from: the cycles that end in an off phase
            off = [mib for now, mib in rows if (now % period) > HOT_PHASE or (now % period) == 0]
            print(f"decay={decay} seed={seed}: hot range pinned, MiB per cycle: {' '.join(str(m) for _, m in rows)}"
                  f" | lowest at the end of an off-phase cycle: {min(off) if off else '-'}")


if __name__ == "__main__":
    main()
