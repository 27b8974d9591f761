"""Issue 21, third attempt: two more levers on the kernel's lists for written units (off-line).

The kernel's lists lose to LRU at 64 KiB units because a write marks
nothing (docs/replay.md, "Real traces"). Two more things the agent could do
to the units the guest wrote, replayed on :class:`LinuxCache` (no pins), by
device reads per guest request:

- **C, drops** (``--set c``): every 10 s the agent drops from the cache
  (``POSIX_FADV_DONTNEED``, no shadow left) the resident units the guest
  wrote in the interval: those not read in it (the read counter), those
  also never written before (``first``), those never read at all, each also
  behind a per-disk gate (dropped only while under half of the written units
  are accessed again within 6 intervals), and - the bound of any such choice -
  those whose next costly access is more than ``T`` s away (hindsight);
- **D, refresh** (``--set d``): every interval the agent ``mlock``s and
  ``munlock``s the resident pages of each unit the guest wrote, which puts an
  inactive folio back at the inactive list's head (``__munlock_folio`` ->
  ``lruvec_add_folio``) without activating it: LRU's recency for writes, at
  the cycle's pace. With ``--pages`` the units are pages and the agent's
  1 MiB (or 64 KiB) model blocks are what it refreshes, as the dirty bitmap and
  the residency scan would let it; ``rewritten``: only blocks written in an
  earlier interval within 30.

    .venv/bin/python -m bench.write_levers /tmp/webserver.csv --set d [--pages --budget 29M,119M,476M]

Budgets default to the trace's footprint / 64, 16, 4 (64 KiB units).
Deterministic; SQL Server ~2 s a set, the web server ~20 s.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np
from numpy.typing import NDArray

from bench.write_marks import UNIT, ReaccessShare, footprint_budgets, hindsight
from vmcache.replay.accesses import BlockTrace, cycle_ends, to_blocks
from vmcache.replay.baselines import LinuxCache, belady, linux, lru
from vmcache.replay.measures import measure
from vmcache.replay.trace import read_trace
from vmcache.units import parse_size

PAGE = 4096
Act = Callable[[LinuxCache, int, slice], None]
"""(the cache, the interval's index, its accesses) -> what the agent does at the interval's end."""


def with_agent(bt: BlockTrace, capacity: int, interval: float, act: Act) -> NDArray[np.bool_]:
    """Hit per access of the kernel's lists with ``act`` at the end of every ``interval`` s."""
    cache = LinuxCache(capacity, unit_bytes=bt.block_size)
    block, write = bt.block.tolist(), bt.write.tolist()
    hits, begin = bytearray(len(bt)), 0
    for k, end in enumerate(cycle_ends(bt, interval)):
        for i in range(begin, end):
            hits[i] = cache.access(block[i], write[i])
        act(cache, k, slice(begin, end))
        begin = end
    return np.frombuffer(bytes(hits), dtype=bool)


def _written_and_read(bt: BlockTrace, span: slice) -> tuple[set[int], set[int]]:
    unit, wr = bt.block[span], bt.write[span]
    return set(np.unique(unit[wr]).tolist()), set(np.unique(unit[~wr]).tolist())


def drops(bt: BlockTrace, which: str, *, gate: bool = False) -> Act:
    """C: drop the written units ``which`` says (``unread``, ``first``, ``never-read``), behind the gate or not."""
    written_ever: set[int] = set()
    read_ever: set[int] = set()
    tracker = ReaccessShare(bt, 6) if gate else None

    def act(cache: LinuxCache, k: int, span: slice) -> None:
        written, read = _written_and_read(bt, span)
        read_ever.update(read)
        drop = {"unread": written - read, "first": written - read - written_ever,
                "never-read": written - read_ever}[which]
        written_ever.update(written)
        if tracker is not None and tracker.update(span) >= 0.5:
            return
        for u in drop:
            cache.discard(u)
    return act


def hindsight_drops(bt: BlockTrace, seconds: float) -> Act:
    """C's bound: drop the written units whose next costly access is more than ``seconds`` away."""
    keep = hindsight(bt, seconds)
    t0 = float(bt.time[0])

    def act(cache: LinuxCache, k: int, span: slice) -> None:
        written = [u for u in _written_and_read(bt, span)[0] if u in cache]
        for u in set(written) - set(keep(written, k, t0 + 10.0 * (k + 1), span)):
            cache.discard(u)
    return act


def refresh(bt: BlockTrace, group: int = 1, horizon: int | None = None) -> Act:
    """D: every inactive unit of each group of ``group`` units written in the interval goes to the inactive head.

    Oldest first, so the list keeps their order; a ``horizon``: only groups
    written in an earlier interval within it as well.
    """
    last: dict[int, int] = {}

    def act(cache: LinuxCache, k: int, span: slice) -> None:
        groups = {u // group for u in _written_and_read(bt, span)[0]}
        chosen = groups if horizon is None else {g for g in groups if k - last.get(g, -horizon - 1) <= horizon}
        last.update((g, k) for g in groups)
        cache.refresh([u for u in cache.inactive_units() if u // group in chosen])
    return act


def arms(name: str, bt: BlockTrace, capacity: int, pages: bool) -> dict[str, NDArray[np.bool_]]:
    if name == "c":
        out = {f"drop {w}{' gated' if g else ''}": with_agent(bt, capacity, 10.0, drops(bt, w, gate=g))
               for w in ("unread", "first", "never-read") for g in (False, True)}
        return out | {f"drop hindsight > {t:g}s": with_agent(bt, capacity, 10.0, hindsight_drops(bt, t))
                      for t in (60.0, 300.0)}
    if pages:
        return {"refresh 1 MiB blocks written": with_agent(bt, capacity, 10.0, refresh(bt, 256)),
                "refresh 1 MiB blocks rewritten": with_agent(bt, capacity, 10.0, refresh(bt, 256, 30)),
                "refresh 64 KiB blocks written": with_agent(bt, capacity, 10.0, refresh(bt, 16))}
    return {f"refresh written @{iv:g}s": with_agent(bt, capacity, iv, refresh(bt)) for iv in (10.0, 1.0)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--set", choices=("c", "d"), default="d")
    p.add_argument("--pages", action="store_true", help="4 KiB units (set d), the agent acting on model blocks")
    p.add_argument("--budget", help="comma-separated sizes (default: footprint / 64, 16, 4 at 64 KiB units)")
    args = p.parse_args()
    trace = read_trace(args.trace)
    bt = to_blocks(trace, UNIT)
    budgets = [parse_size(b, key="budget") for b in args.budget.split(",")] if args.budget else footprint_budgets(bt)
    if args.pages:
        bt = to_blocks(trace, PAGE)
    for budget in budgets:
        cap = budget // bt.block_size
        rows = {"lru": lru(bt, cap), "linux": linux(bt, cap)} | ({} if args.pages else {"belady": belady(bt, cap)})
        rows |= arms(args.set, bt, cap, args.pages)
        figures = {k: measure(k, budget, bt, h).reads_per_request for k, h in rows.items()}
        best = min(figures["lru"], figures["linux"])
        print(f"{budget >> 20} MiB: " + "; ".join(
            f"{k} {v:.4f}" + ("" if k in ("lru", "linux", "belady") else
                              f" ({100 * (v / best - 1):+.1f}% vs best, {100 * (v / figures['linux'] - 1):+.1f}% vs "
                              "the kernel's lists)") for k, v in figures.items()), flush=True)


if __name__ == "__main__":
    main()
