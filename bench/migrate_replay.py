"""What a live migration carries, judged on a trace (docs/replay.md, "What a migration carries").

The trace's first part (``--cut``, a share of its requests; the migration
bench's web guest moves at 0.6) runs through the agent's cycle on host A
(the replay's ``vmcache`` arm); at the cut the guest moves to host B, whose
page cache is empty, and the rest runs there from the start, per arm:

- ``kernel``: no vmcache (the kernel's lists from cold);
- ``carried``: B restores what A's live definition carried at the cut
  (vmcache.model.saveset ``carried_regions``: the blocks with proven reuse);
- ``start-set``: B restores the set a start saves instead (the most read,
  every block read a candidate: what the carried set was before it asked
  for reuse).

Per arm over the first ``--head`` seconds on B and over the whole rest:
device reads (the guest's misses and the restore's loads, 4 KiB pages) and
the guest's read hit ratio. Deterministic; no host needed.

``web-window`` for TRACE is the migration bench's web guest: the web server
trace's requests that fit its 2 GiB disk, at the offsets it replays them
(bench/e2e_trace.py).

Run: .venv/bin/python bench/migrate_replay.py TRACE|web-window [--cut 0.6] [--budget 256M] [--head 60]
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import numpy as np

from vmcache.model.params import ModelParams
from vmcache.replay.accesses import to_blocks
from vmcache.replay.baselines import linux
from vmcache.replay.sim import saved_hotset, vmcache
from vmcache.replay.trace import Trace, read_trace
from vmcache.units import parse_size

UNIT = 4096
MiB = 1 << 20


def part(trace: Trace, lo: int, hi: int) -> Trace:
    return Trace(trace.time[lo:hi], trace.write[lo:hi], trace.offset[lo:hi], trace.length[lo:hi])


def web_window(disk: int = 2 << 30) -> Trace:
    """The web server trace as the migration bench's guest replays it (bench/e2e_trace.py)."""
    import e2e_trace
    t = e2e_trace.load(e2e_trace.TRACES["webserver"])
    w = t.head(e2e_trace.fitting_prefix(t, disk))
    mapped = e2e_trace.offset_map(w)(w.offsets)
    return Trace(w.times - w.times[0], w.writes, mapped.astype(np.int64), w.lengths.astype(np.int64))


def figures(name: str, bt, hits: np.ndarray, load_times: np.ndarray, head: float, carried: int) -> str:
    t0 = float(bt.time[0])
    reads = ~bt.write
    dev = bt.costly & ~hits
    cells = [name, f"{carried / MiB:.0f}"]
    for end in (t0 + head, float("inf")):
        first = bt.time < end
        loaded = int((load_times < end).sum())
        rd = reads & first
        cells += [f"{int(dev[first].sum()):,}", f"{loaded:,}", f"{int(dev[first].sum()) + loaded:,}",
                  f"{int((hits & rd).sum()) / max(1, int(rd.sum())):.3f}"]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--cut", type=float, default=0.6, help="share of the requests run on A (default 0.6)")
    ap.add_argument("--budget", default="256M", help="the disk's pin budget and the cache (default 256M)")
    ap.add_argument("--memory", default="1G", help="each host's page cache for the image (default 1G)")
    ap.add_argument("--head", type=float, default=60.0, help="seconds after the switch (default 60)")
    ap.add_argument("--prefetch-rate", default="8M")
    ap.add_argument("--warm-rate", default="32M")
    ap.add_argument("--size", default="", help="the image's size (default: the trace's end, in MiB)")
    args = ap.parse_args()
    trace = web_window() if args.trace == "web-window" else read_trace(args.trace)
    cut = int(round(len(trace) * args.cut))
    size = parse_size(args.size) if args.size else -(-trace.end // MiB) * MiB
    budget, capacity = parse_size(args.budget), parse_size(args.memory) // UNIT
    p = replace(ModelParams(), block_size=MiB)
    rates = {"prefetch_rate": parse_size(args.prefetch_rate), "warm_rate": parse_size(args.warm_rate)}
    on_a = to_blocks(part(trace, 0, cut), UNIT, size)
    on_b = to_blocks(part(trace, cut, len(trace)), UNIT, size)
    a = vmcache(on_a, capacity, params=p, pin_budget=budget, size_bytes=size, prefetch_rate=rates["prefetch_rate"])
    print(f"{args.trace}: {cut:,} requests on A ({on_a.time[-1] - on_a.time[0]:.0f} s), "
          f"{len(trace) - cut:,} on B ({on_b.time[-1] - on_b.time[0]:.0f} s); budget {args.budget}, "
          f"cache {args.memory} a host, 1 MiB blocks, 4 KiB pages")
    print(f"\n| arm | set MiB | misses, first {args.head:.0f} s | loads | device reads | read hit ratio "
          "| misses, all | loads | device reads | read hit ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(figures("kernel", on_b, linux(on_b, capacity), np.zeros(0), args.head, 0))
    for name, regions in (("carried", a.carried), ("start-set", a.hot)):
        warm = saved_hotset(list(regions), tuple(0 for _ in regions), p, size, ordered=False)  # both by heat
        run = vmcache(on_b, capacity, params=p, pin_budget=budget, size_bytes=size, warm=warm, **rates)
        times, _ = run.loads.arrays()
        print(figures(name, on_b, run.hits, times, args.head, sum(r.length for r in regions)))


if __name__ == "__main__":
    main()
