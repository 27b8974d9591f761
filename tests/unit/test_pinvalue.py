"""PinValue: the reads a disk's pins served that the kernel alone would likely have missed."""

from __future__ import annotations

import math

import numpy as np
import pytest

from vmcache.model.blocks import BlockValues
from vmcache.model.pinvalue import PinValue


def bv(d: dict[int, float]) -> BlockValues:
    keys = sorted(d)
    return BlockValues(np.array(keys, np.int64), np.array([d[k] for k in keys], np.float32))


NONE = np.zeros(0, np.int64)


def test_a_pin_read_at_a_gap_the_kernel_misses_at_saves_its_hits_and_one_it_keeps_saves_nothing() -> None:
    v = PinValue(100)
    # unpinned blocks 10..19 read at t=0, then again 100 s later: all missed (the kernel dropped them);
    # unpinned blocks 20..29 read at t=0 and again 1 s later: all hits
    v.add(bv({b: 4 for b in range(10, 30)}), bv({b: 4 for b in range(10, 30)}), NONE, 0.0)
    v.add(bv({b: 4 for b in range(20, 30)}), bv({}), NONE, 1.0)
    assert v.add(bv({b: 4 for b in range(10, 20)}), bv({b: 4 for b in range(10, 20)}), NONE, 100.0) == 0.0
    assert v.retention() == 64.0            # the first gap bin where most re-reads missed: [64, 128) s
    # a pinned block read at t=0 and again 100 s later: its 8 hits would have missed
    pinned = np.array([50], np.int64)
    v.add(bv({50: 8}), bv({50: 8}), pinned, 0.0)  # loaded by that read (missed): worth nothing
    assert v.add(bv({50: 8}), bv({}), pinned, 100.0) == pytest.approx(8.0)
    # and read again 1 s later, a gap the kernel keeps: nothing saved
    assert v.add(bv({50: 8}), bv({}), pinned, 101.0) == 0.0
    assert v.saved_pages == pytest.approx(8.0)


def test_no_evidence_of_the_kernel_missing_claims_no_saving() -> None:
    v = PinValue(10)
    pinned = np.array([1], np.int64)
    v.add(bv({1: 8}), bv({}), pinned, 0.0)
    assert v.add(bv({1: 8}), bv({}), pinned, 1000.0) == 0.0
    assert v.retention() is None and v.saved_pages == 0.0


def test_a_kernel_that_keeps_everything_read_again_has_infinite_retention() -> None:
    v = PinValue(64)
    v.add(bv({b: 1 for b in range(40)}), bv({b: 1 for b in range(40)}), NONE, 0.0)
    v.add(bv({b: 1 for b in range(40)}), bv({}), NONE, 500.0)
    assert v.retention() == math.inf
    # first reads of unpinned blocks all missed: a restored pin's first read is worth its hits
    pinned = np.array([60], np.int64)
    assert v.add(bv({60: 4}), bv({}), pinned, 501.0) == pytest.approx(4.0)


def test_evidence_fades_with_the_half_life() -> None:
    v = PinValue(64, half_life=10.0)
    v.add(bv({b: 1 for b in range(32)}), bv({b: 1 for b in range(32)}), NONE, 0.0)
    assert not np.isnan(v.miss_share()[-1])
    v.add(bv({}), bv({}), NONE, 100.0)       # 2**-10 of 32 pages left: too little to believe
    assert np.isnan(v.miss_share()[-1])


def test_resize_keeps_the_last_reads_and_reads_past_the_end_are_ignored() -> None:
    v = PinValue(4)
    v.add(bv({1: 1, 9: 1}), bv({}), NONE, 0.0)
    v.resize(16)
    v.add(bv({9: 1}), bv({}), NONE, 1.0)   # block 9 is new to the map: a first read
    v.resize(2)
    v.add(bv({1: 1}), bv({}), NONE, 2.0)
    with pytest.raises(ValueError):
        v.add(bv({}), bv({}), NONE, math.nan)
    with pytest.raises(ValueError):
        PinValue(-1)


def test_the_pins_cost_their_share_of_the_refaults_under_the_cache_they_press_on() -> None:
    from vmcache.model.pinvalue import PinCost

    c = PinCost()
    assert c.add(1000, 400 << 20, 100 << 20) == 0.0          # the first look: a baseline
    assert c.add(1200, 400 << 20, 100 << 20) == pytest.approx(50.0)   # 200 refaults, the pins a quarter
    assert c.add(1300, 400 << 20, 0) == 0.0                   # nothing pinned: no cost
    assert c.add(10, 400 << 20, 100 << 20) == 0.0             # another cgroup's counter: a new baseline
    assert c.add(30, 10 << 20, 100 << 20) == pytest.approx(20.0)      # share at most 1
    assert c.cost_pages == pytest.approx(70.0)
    with pytest.raises(ValueError):
        c.add(-1, 0, 0)


def test_the_disks_own_re_read_misses_are_not_a_cost_to_the_others() -> None:
    from vmcache.model.pinvalue import PinCost

    v = PinValue(64)
    v.add(bv({b: 4 for b in range(8)}), bv({b: 4 for b in range(8)}), NONE, 0.0)
    assert v.reread_missed == 0.0                      # first reads: not refaults
    v.add(bv({b: 4 for b in range(8)}), bv({b: 2 for b in range(4)}), NONE, 50.0)
    assert v.reread_missed == 8.0                      # read before and missed: the disk's own refaults
    c = PinCost()
    c.add(1000, 400 << 20, 100 << 20)
    # 208 refaulted under the limit, 8 of them the disk's own: the pins (a quarter) cost the others 50
    assert c.add(1208, 400 << 20, 100 << 20, own=v.reread_missed) == pytest.approx(50.0)
    assert c.add(1210, 400 << 20, 100 << 20, own=8.0) == 0.0   # all the disk's own: no cost


def test_the_last_reads_are_sparse_and_bounded_however_large_the_disk() -> None:
    v = PinValue(64 << 20, keep=4)   # a 64 TiB disk of 1 MiB blocks: nothing allocated per block
    for t in range(10):
        v.add(bv({t * 1000: 1}), bv({}), NONE, float(t))
    assert v._read.size <= 8 and v._read[-1] == 9000   # the most recent kept
    assert 0 not in v._read                             # the oldest forgotten: its next read counts as a first


def test_a_cycle_over_a_64_tib_disk_allocates_nothing_per_block_for_it() -> None:
    import tracemalloc

    from vmcache.model.params import ModelParams

    from vmcache.model.cycle import Cycle

    tracemalloc.start()
    try:
        cycle = Cycle(ModelParams(), 64 << 20)   # 1 MiB blocks
        cycle.pin_value.add(bv({5: 4}), bv({5: 4}), NONE, 0.0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, peak   # a dense float per block would be 512 MiB
