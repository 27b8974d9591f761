"""CPU cost of saving a hot set of a 1 TiB image: the set chosen each cycle, the element at each save.

Run: .venv/bin/python bench/bench_hotset.py [--saves N] [--size 1T] [--budget 4G]

What the agent does (service/hotsets.py), minus the libvirt call: the set
(model/saveset.saved_regions: the blocks the guest read most within the
budget, up to 1024 regions), each cycle, because the live XML's set follows
it (HotSetKeeper.follow); here the read tally is full (twice
saveset.TALLY_BLOCKS blocks read, scattered over the image) and every one
of the 1M blocks of a 1 TiB image at the default 1 MiB blocks has heat, the
worst case. At each save the element too (settings/hotset.build_hotset),
and parse_hotset of it (what a warm start reads once). CPU time
(time.process_time), median and spread over ``--saves`` repetitions. The
libvirt call (virDomainSetMetadata, live and persistent) is measured by the
live test and logged by the agent (``hotset.saved ... cpu_ms=``): its CPU is
mostly libvirtd's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vmcache.model.blocks import BlockValues
from vmcache.model.heat import ActiveHeat
from vmcache.model.params import ModelParams
from vmcache.model.saveset import TALLY_BLOCKS, saved_regions
from vmcache.settings.hotset import DiskHotSet, HotSet, build_hotset, parse_hotset
from vmcache.units import parse_size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=50)
    parser.add_argument("--size", default="1T")
    parser.add_argument("--budget", default="4G")
    parser.add_argument("--block-size", default="1M")
    args = parser.parse_args()
    size, bs, budget = parse_size(args.size), parse_size(args.block_size), parse_size(args.budget)
    nblocks = size // bs
    rng = np.random.default_rng(2)
    values = rng.random(nblocks, dtype=np.float32)
    heat = ActiveHeat(np.arange(nblocks, dtype=np.int64), values, values)
    read = np.sort(rng.choice(nblocks, min(nblocks, 2 * TALLY_BLOCKS), replace=False)).astype(np.int64)
    counts = BlockValues(read, rng.random(read.size, dtype=np.float32) * 1000)
    params = ModelParams(block_size=bs)
    pick_ms, save_ms, parse_ms = [], [], []
    text = ""
    regions = 0
    for _ in range(args.saves):
        started = time.process_time()
        hot = saved_regions(counts, heat, params, budget=budget, size_bytes=size)
        pick_ms.append((time.process_time() - started) * 1e3)
        regions = len(hot)
        started = time.process_time()
        record = DiskHotSet("vda", "/var/lib/libvirt/images/web-1.img", size, "0" * 32, bs, tuple(hot))
        text = build_hotset(HotSet(saved=int(time.time()), disks=(record,)))
        save_ms.append((time.process_time() - started) * 1e3)
        started = time.process_time()
        parse_hotset(text)
        parse_ms.append((time.process_time() - started) * 1e3)

    def spread(values: list[float]) -> str:
        return f"median {statistics.median(values):.3f} ms (min {min(values):.3f}, max {max(values):.3f})"

    print(f"a {args.size} image, {args.block_size} blocks ({nblocks} blocks, {read.size} read), budget "
          f"{args.budget}: {regions} regions, {args.saves} repetitions")
    print(f"element: {len(text)} characters")
    print(f"the set (saved_regions, every cycle): {spread(pick_ms)}")
    print(f"the element (build_hotset, at a save): {spread(save_ms)}")
    print(f"parse (warm start, once): {spread(parse_ms)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
