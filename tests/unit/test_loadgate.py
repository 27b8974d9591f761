"""LoadGate: new pins fill only the partly cached blocks the guest is spreading through (pure)."""

from __future__ import annotations

import numpy as np

from vmcache.model.blocks import BlockValues
from vmcache.model.cycle import Cycle
from vmcache.model.loadgate import GROWTH_CYCLES, RISES, LoadGate
from vmcache.model.params import ModelParams
from vmcache.model.region import Region

BS = 1 << 20
NONE = np.zeros(0, np.int64)


def listed(values: dict[int, float]) -> BlockValues:
    index = np.array(sorted(values), dtype=np.int64)
    return BlockValues(index, np.array([values[i] for i in index.tolist()], dtype=np.float32))


def stale_after(gate: LoadGate, *cycles: dict[int, float], ours: tuple[int, ...] = (), heated: tuple[int, ...] = ()
                ) -> list[list[int]]:
    out = []
    for values in cycles:
        gate.update(listed(values), np.array(ours, np.int64), np.array(heated, np.int64))
        out.append(gate.stale.tolist())
    return out


def test_a_block_is_filled_only_while_the_guest_spreads_through_it() -> None:
    # block 1: read once in part (one rise), then re-read; 2: grows at the 1st, 3rd and 4th cycles, then stays;
    # 3: whole; 4: half, then the kernel lets half of that go
    cycles = [{1: 0.25, 2: 0.25, 3: 1.0, 4: 0.5}, {1: 0.25, 2: 0.25, 3: 1.0, 4: 0.5},
              {1: 0.25, 2: 0.5, 3: 1.0, 4: 0.25}, {1: 0.25, 2: 0.75, 3: 1.0, 4: 0.25}]
    cycles += [{1: 0.25, 2: 0.75, 3: 1.0, 4: 0.25}] * GROWTH_CYCLES
    stale = stale_after(LoadGate(), *cycles)
    assert stale[:4] == [[1, 2, 4], [1, 2, 4], [1, 4], [1, 4]]
    assert stale[4:] == [[1, 4], [1, 4], [1, 2, 4]]  # 2: GROWTH_CYCLES without a new peak
    assert RISES == 2


def test_an_evicted_block_is_remembered_while_it_has_heat_and_reread_pages_set_no_new_peak() -> None:
    gate = LoadGate()
    # 5: a quarter read, evicted, the same pages read again; 7 and 8: read whole, evicted, half read again
    assert stale_after(gate, {5: 0.25, 7: 1.0, 8: 1.0}, {}, heated=(5, 7)) == [[5], [5]]
    assert stale_after(gate, {5: 0.25, 7: 0.5, 8: 0.5}) == [[5, 8]]  # 8, forgotten, is a first read again
    assert stale_after(gate, {5: 0.5, 7: 0.5, 8: 0.5}) == [[8]]  # 5 grew past its peak a second time


def test_what_a_pin_loaded_is_not_the_guests_reach() -> None:
    gate = LoadGate()
    assert stale_after(gate, {5: 0.25}) == [[5]]
    assert stale_after(gate, {5: 0.5}, {5: 1.0}, ours=(5,)) == [[5], []]  # filling, filled: nothing to gate
    assert stale_after(gate, {5: 0.75}, ours=(5,)) == [[5]]  # released and partly evicted: the guest read 0.25


def test_cut_splits_a_new_region_around_stale_blocks_and_keeps_pinned_ones() -> None:
    gate = LoadGate()
    stale_after(gate, {10: 0.5, 12: 0.5, 14: 0.5})
    region = Region(10 * BS, 6 * BS, 60.0)
    pins = np.array([14], np.int64)  # the blocks of a pin now
    cut = gate.cut([region], pins, BS, most=10)
    assert [(r.start // BS, r.end // BS) for r in cut] == [(13, 16), (11, 12)]
    assert [r.priority for r in cut] == [30.0, 10.0]
    assert gate.cut([region], pins, BS, most=1) == [cut[0]]
    other = Region(20 * BS, 2 * BS, 5.0)
    assert gate.cut([other], NONE, BS, most=10) == [other]


def test_the_cycle_does_not_fill_a_block_the_guest_reads_the_same_part_of() -> None:
    params = ModelParams(block_size=BS, interval=10.0, threshold=0.03, merge_gap=0, min_region=1)
    resident = np.zeros(8, np.float32)
    resident[2] = 0.5  # the guest reads the same half of block 2, cycle after cycle
    cycle = Cycle(params, 8)
    for step in range(6):
        resident[5] = 0.125 * (step + 1)  # and spreads through block 5
        plan = cycle.step(resident, np.zeros(8, np.float32), [], size_bytes=8 * BS, budget=8 * BS, now=10.0 * step)
    blocks = {b for r in plan.regions for b in range(r.start // BS, -(-r.end // BS))}
    assert 5 in blocks and 2 not in blocks
