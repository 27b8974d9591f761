"""A saved set restored in the order its guest first read it after its last start (issue 42 item 2)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from vmcache.model.blocks import BlockValues
from vmcache.model.cycle import Cycle
from vmcache.model.heat import HeatModel
from vmcache.model.params import ModelParams
from vmcache.model.region import Region
from vmcache.model.saveset import ReadTally
from vmcache.model.warm import WarmStart

MiB = 1 << 20
P = replace(ModelParams(), block_size=MiB)
HOT = Region(0, 8 * MiB, 8.0)          # the hotter, read late in the last run
EARLY = Region(40 * MiB, 4 * MiB, 2.0)  # cooler, read first


def test_the_tally_keeps_the_cycle_of_each_blocks_first_read_since_the_start() -> None:
    tally = ReadTally()
    tally.add(BlockValues(np.array([5], np.int64), np.ones(1, np.float32)), 100.0)   # cycle 1: the start
    tally.add(BlockValues(np.array([5, 9], np.int64), np.ones(2, np.float32)), 125.0)  # 25 s in: cycle 3
    regions = [Region(5 * MiB, MiB), Region(8 * MiB, 2 * MiB), Region(4 * MiB, 6 * MiB), Region(20 * MiB, MiB)]
    assert tally.first_cycles(regions, P) == (1, 3, 1, 0)


def test_by_first_read_orders_a_plan_by_when_the_guest_read_it_last_time() -> None:
    warm = WarmStart([(HOT, 1.0), (EARLY, 0.5)], P, {HOT.span: 30, EARLY.span: 1})
    new = Region(20 * MiB, MiB, 9.0)  # read now: new heat
    warm.seed(HeatModel(P, 100), 0.0)
    plan = [HOT, new, EARLY]
    assert warm.by_first_read(plan, 0.0) == [EARLY, new, HOT]
    # 40 cycles in, what the guest read in cycle 30 last time is due before what it reads now
    assert warm.by_first_read(plan, 400.0) == [EARLY, HOT, new]
    unordered = WarmStart([(HOT, 1.0), (EARLY, 0.5)], P)  # a set saved before the order was kept
    unordered.seed(HeatModel(P, 100), 0.0)
    assert unordered.by_first_read(plan, 0.0) == plan


def _restore_order(first_read: dict[tuple[int, int], int] | None) -> list[list[tuple[int, int]]]:
    """The regions pinned after each of the first cycles of a warm start at 4 MiB a cycle."""
    cycle = Cycle(P, 100, prefetch_rate=MiB // 10, warm_rate=-(-4 * MiB // 10))  # 4 MiB a 10 s cycle
    cycle.warm = WarmStart([(HOT, 1.0), (EARLY, 0.5)], P, first_read)
    pinned: list[Region] = []
    seen = []
    none = BlockValues.empty()
    for k in range(3):
        pinned = cycle.step(none, none, pinned, size_bytes=100 * MiB, budget=16 * MiB, now=10.0 * k).regions
        cycle.pinned(pinned)
        seen.append(sorted(r.span for r in pinned))
    return seen


def test_the_restore_loads_what_the_guest_read_first_before_what_is_hotter() -> None:
    ordered = _restore_order({HOT.span: 12, EARLY.span: 1})
    assert ordered[0] == [EARLY.span]  # the 4 MiB the guest read first, in the first cycle
    assert (HOT.start, 4 * MiB) in ordered[1] and EARLY.span in ordered[1]
    by_heat = _restore_order(None)
    assert by_heat[0] == [(HOT.start, 4 * MiB)]  # heat order: the first half of the hotter region
