"""CPU cost of saving a hot set: 1024 held regions of a 1 TiB image, per save and per cycle.

Run: .venv/bin/python bench/bench_hotset.py [--saves N] [--regions 1024] [--size 1T]

What the agent does at each save (service/hotsets.py), minus the libvirt
call: the heat of every held region (model/warm.heat_of: one slice of the
blocks with heat per region; here every one of the 1M blocks of a 1 TiB
image at the default 1 MiB blocks has heat, the worst case) and the
element (settings/hotset.build_hotset). Also parse_hotset of the
result (what a warm start reads once). CPU time (time.process_time),
median and spread over ``--saves`` repetitions; the per-cycle cost is a
save's divided by the cycles between saves (hotset_interval / interval,
300 s / 10 s by default). The libvirt call (virDomainSetMetadata, live and
persistent) is measured by the live test and logged by the agent
(``hotset.saved ... cpu_ms=``): its CPU is mostly libvirtd's.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vmcache.model.heat import ActiveHeat
from vmcache.model.region import Region
from vmcache.model.warm import heat_of
from vmcache.settings.hotset import DiskHotSet, HotSet, build_hotset, parse_hotset
from vmcache.units import parse_size


def held_regions(count: int, nblocks: int, bs: int, seed: int = 1) -> list[Region]:
    """``count`` disjoint regions of 1-64 blocks spread over the image (the planner's cap is 1024)."""
    rng = random.Random(seed)
    slot = nblocks // count
    regions = []
    for i in range(count):
        blocks = rng.randint(1, min(64, slot))
        first = i * slot + rng.randint(0, slot - blocks)
        regions.append(Region(first * bs, blocks * bs, 0.0))
    return regions


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=50)
    parser.add_argument("--regions", type=int, default=1024)
    parser.add_argument("--size", default="1T")
    parser.add_argument("--block-size", default="1M")
    parser.add_argument("--cycles-per-save", type=int, default=30, help="hotset_interval / interval (300s / 10s)")
    args = parser.parse_args()
    size, bs = parse_size(args.size), parse_size(args.block_size)
    nblocks = size // bs
    values = np.random.default_rng(2).random(nblocks, dtype=np.float32)
    heat = ActiveHeat(np.arange(nblocks, dtype=np.int64), values, values)
    regions = held_regions(args.regions, nblocks, bs)
    save_ms, parse_ms = [], []
    text = ""
    for _ in range(args.saves):
        started = time.process_time()
        hot = heat_of(regions, heat, bs)
        record = DiskHotSet("vda", "/var/lib/libvirt/images/web-1.img", size, "0" * 32, bs, tuple(hot))
        text = build_hotset(HotSet(saved=int(time.time()), disks=(record,)))
        save_ms.append((time.process_time() - started) * 1e3)
        started = time.process_time()
        parse_hotset(text)
        parse_ms.append((time.process_time() - started) * 1e3)

    def spread(values: list[float]) -> str:
        return f"median {statistics.median(values):.3f} ms (min {min(values):.3f}, max {max(values):.3f})"

    print(f"{args.regions} regions of a {args.size} image, {args.block_size} blocks ({nblocks} blocks), "
          f"{args.saves} saves")
    print(f"element: {len(text)} characters")
    print(f"save (heat_of + build_hotset): {spread(save_ms)}")
    print(f"per cycle at one save every {args.cycles_per_save} cycles: "
          f"{statistics.median(save_ms) / args.cycles_per_save:.3f} ms")
    print(f"parse (warm start, once): {spread(parse_ms)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
