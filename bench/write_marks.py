"""Issue 21, second attempt: could the agent make up for the kernel's blind spot on writes? (off-line)

The kernel's lists lose to LRU on the real traces because a buffered write
marks nothing (docs/replay.md, "Real traces"). Two remedies the agent could
apply, replayed on the Linux-like lists (:class:`LinuxCache`, no pins unless
said), by device reads per guest request:

- **A, marks** (``--set a``): every ``interval`` seconds the agent reads
  each resident unit the guest wrote since (the dirty bitmap) ``marks``
  times from its own descriptor - ``folio_mark_accessed``, two marks
  activate (:meth:`LinuxCache.mark`). Which written units: all of them,
  those written in an earlier interval within ``h`` intervals too
  (``rewritten``: what the bitmap's history shows), at most a share of the
  resident units (``cap``, most often written first), only while the
  share of written units written or read again within a minute is at least
  0.5 (``re-accessed``: a per-disk gate the agent can learn), or - the bound of
  any such gate - those whose next costly access comes within ``T``
  seconds of the mark (``hindsight``);
- **B, pins by cost** (``--set b``): each 10 s cycle, a per-unit score of
  what the agent sees cost the device - read misses (exact, as
  :class:`~vmcache.model.reads.GuestReads` gives them) and, with weight
  ``w``, writes to a unit written before (the bitmap: a rewrite, which may
  be a partial-page write reading what the kernel let go) - decays by
  0.999 a cycle; the units scoring at least 2 are pinned, best first, up to
  ``share`` of the memory, over the kernel's lists; loads are free, as in
  the replay.

    .venv/bin/python -m bench.write_marks /tmp/webserver.csv --set a [--budget 65M,262M]

Budgets default to the trace's footprint / 64, 16, 4 (as ``vmcache
replay``); 64 KiB units. Deterministic; SQL Server ~10 s a set, the web
server ~1 min.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from collections.abc import Callable

import numpy as np
from numpy.typing import NDArray

from vmcache.replay.accesses import BlockTrace, cycle_ends, next_use, to_blocks
from vmcache.replay.baselines import LinuxCache, belady, linux, lru
from vmcache.replay.measures import measure
from vmcache.replay.sim import Memory
from vmcache.replay.trace import read_trace
from vmcache.units import parse_size

UNIT = 64 * 1024
Choose = Callable[[list[int], int, float, slice], list[int]]
"""(resident units written in the interval, its index, the mark's trace time, its accesses) -> the units to mark."""


def footprint_budgets(bt: BlockTrace) -> list[int]:
    fp, mib = int(np.unique(bt.block).size) * bt.block_size, 1 << 20
    return sorted({max(bt.block_size, fp // f // mib * mib) for f in (64, 16, 4)})


def marked(bt: BlockTrace, capacity: int, interval: float, marks: int, choose: Choose | None = None
           ) -> NDArray[np.bool_]:
    """Hit per access of the kernel's lists with the agent marking written units every ``interval`` s."""
    cache = LinuxCache(capacity, unit_bytes=bt.block_size)
    block, write = bt.block.tolist(), bt.write.tolist()
    hits, begin, t0 = bytearray(len(bt)), 0, float(bt.time[0])
    for k, end in enumerate(cycle_ends(bt, interval)):
        for i in range(begin, end):
            hits[i] = cache.access(block[i], write[i])
        written = [u for u in np.unique(bt.block[begin:end][bt.write[begin:end]]).tolist() if u in cache]
        if choose is not None:
            written = choose(written, k, t0 + interval * (k + 1), slice(begin, end))
        for _ in range(marks):
            for u in written:
                cache.mark(u)
        begin = end
    return np.frombuffer(bytes(hits), dtype=bool)


def rewritten(horizon: int) -> Choose:
    """Units also written in an earlier interval, at most ``horizon`` intervals ago (the bitmap's history)."""
    last: dict[int, int] = {}

    def choose(units: list[int], k: int, now: float, span: slice) -> list[int]:
        out = [u for u in units if k - last.get(u, -horizon - 1) <= horizon]
        last.update((u, k) for u in units)
        return out
    return choose


def capped(share: float, capacity: int) -> Choose:
    """At most ``share`` of the memory's units a mark, the most often written (halved every 6 intervals) first."""
    score: defaultdict[int, float] = defaultdict(float)

    def choose(units: list[int], k: int, now: float, span: slice) -> list[int]:
        for u in units:
            score[u] += 1.0
        out = sorted(units, key=lambda u: -score[u])[:int(share * capacity)]
        if k % 6 == 0:
            for u in list(score):
                score[u] *= 0.5
                if score[u] < 0.01:
                    del score[u]
        return out
    return choose


class ReaccessShare:
    """The share of written units accessed again within ``horizon`` intervals: a running mean over ~200
    outcomes, from 1 (what the bitmap and the read counter show). :meth:`update` once per interval, in order."""

    def __init__(self, bt: BlockTrace, horizon: int) -> None:
        self._bt, self._horizon = bt, horizon
        self._pending: list[tuple[set[int], set[int]]] = []  # per interval: units written, those accessed since
        self.share = 1.0

    def update(self, span: slice) -> float:
        """Fold in the accesses of one interval; the share after it."""
        bt = self._bt
        touched = set(np.unique(bt.block[span]).tolist())
        for written, again in self._pending:
            again |= written & touched
        self._pending.append((set(np.unique(bt.block[span][bt.write[span]]).tolist()), set()))
        if len(self._pending) > self._horizon:
            written, again = self._pending.pop(0)
            if written:
                self.share += min(1.0, len(written) / 200) * (len(again) / len(written) - self.share)
        return self.share


def reaccessed(bt: BlockTrace, horizon: int, least: float = 0.5) -> Choose:
    """Every written unit while :class:`ReaccessShare` over ``horizon`` intervals is at least ``least``."""
    tracker = ReaccessShare(bt, horizon)

    def choose(units: list[int], k: int, now: float, span: slice) -> list[int]:
        return units if tracker.update(span) >= least else []
    return choose


def hindsight(bt: BlockTrace, seconds: float) -> Choose:
    """Units whose next costly access comes within ``seconds`` of the mark (known from the future)."""
    nxt, cost, time = next_use(bt.block).tolist(), bt.costly.tolist(), bt.time.tolist()
    last: dict[int, int] = {}  # unit -> its last access before the mark
    order = bt.block.tolist()
    seen = 0

    def choose(units: list[int], k: int, now: float, span: slice) -> list[int]:
        nonlocal seen
        while seen < len(time) and time[seen] < now:
            last[order[seen]] = seen
            seen += 1
        out = []
        for u in units:
            j = nxt[last[u]]
            while j < len(cost) and not cost[j]:
                j = nxt[j]
            if j < len(cost) and time[j] - now <= seconds:
                out.append(u)
        return out
    return choose


def pins_by_cost(bt: BlockTrace, capacity: int, share: float, rewrite_weight: float, *, decay: float = 0.999,
                 least: float = 2.0, marks: int = 0) -> NDArray[np.bool_]:
    """Hit per access of B (module docstring) over the kernel's lists; ``marks``: A's marks as well, at 10 s."""
    memory = Memory(LinuxCache(capacity, unit_bytes=bt.block_size), capacity)
    rest = memory.rest
    assert isinstance(rest, LinuxCache)
    block, write = bt.block.tolist(), bt.write.tolist()
    hits, begin = bytearray(len(bt)), 0
    score: defaultdict[int, float] = defaultdict(float)
    written_before: set[int] = set()
    for end in cycle_ends(bt, 10.0):
        memory.serve(block, write, begin, end, hits)
        unit, wr = bt.block[begin:end], bt.write[begin:end]
        hit = np.frombuffer(bytes(hits[begin:end]), dtype=bool)
        for u in unit[~wr & ~hit].tolist():
            score[u] += 1.0
        written = np.unique(unit[wr]).tolist()
        for u in written:
            if u in written_before:
                score[u] += rewrite_weight
        written_before.update(written)
        for _ in range(marks):
            for u in written:
                rest.mark(u)
        for u in list(score):
            score[u] *= decay
            if score[u] < 0.05:
                del score[u]
        top = sorted((u for u, s in score.items() if s >= least), key=lambda u: -score[u])[:int(share * capacity)]
        memory.pin(np.array(sorted(top), dtype=np.int64))
        begin = end
    return np.frombuffer(bytes(hits), dtype=bool)


def arms(name: str, bt: BlockTrace, capacity: int) -> dict[str, NDArray[np.bool_]]:
    if name == "a":
        out = {f"all x{m} @{iv:g}s": marked(bt, capacity, iv, m) for iv in (10.0, 1.0, 0.1) for m in (1, 2)}
        out |= {f"rewritten h{h} @10s": marked(bt, capacity, 10.0, 2, rewritten(h)) for h in (3, 30)}
        out |= {f"cap {c:g} @10s": marked(bt, capacity, 10.0, 2, capped(c, capacity)) for c in (0.02, 0.1)}
        out |= {"re-accessed within 6 cycles >= 0.5 @10s": marked(bt, capacity, 10.0, 2, reaccessed(bt, 6))}
        out |= {f"hindsight {t:g}s @10s": marked(bt, capacity, 10.0, 2, hindsight(bt, t)) for t in (10.0, 300.0)}
        return out
    return {f"share {s:g} w {w:g}": pins_by_cost(bt, capacity, s, w) for s in (0.25, 0.5) for w in (0.0, 0.25, 1.0)
            } | {"share 0.5 w 0.25 + marks @10s": pins_by_cost(bt, capacity, 0.5, 0.25, marks=2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--set", choices=("a", "b"), default="a")
    p.add_argument("--budget", help="comma-separated sizes (default: footprint / 64, 16, 4)")
    args = p.parse_args()
    bt = to_blocks(read_trace(args.trace), UNIT)
    budgets = [parse_size(b, key="budget") for b in args.budget.split(",")] if args.budget else footprint_budgets(bt)
    for budget in budgets:
        cap = budget // UNIT
        rows = {"lru": lru(bt, cap), "linux": linux(bt, cap), "belady": belady(bt, cap)} | arms(args.set, bt, cap)
        figures = {k: measure(k, budget, bt, h).reads_per_request for k, h in rows.items()}
        best = min(figures["lru"], figures["linux"])
        print(f"{budget >> 20} MiB: " + "; ".join(
            f"{k} {v:.4f}" + (f" ({100 * (v / best - 1):+.1f}% vs best, gap closed "
                              f"{(best - v) / (best - figures['belady']):.0%})" if k not in ("lru", "linux", "belady")
                              else "") for k, v in figures.items()), flush=True)


if __name__ == "__main__":
    main()
