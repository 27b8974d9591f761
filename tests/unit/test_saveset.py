"""What a disk saves: the blocks the guest read most, up to the budget (vmcache.model.saveset)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from vmcache.model.blocks import BlockValues
from vmcache.model.cycle import Cycle
from vmcache.model.heat import ActiveHeat
from vmcache.model.params import ModelParams
from vmcache.model.reads import GuestReads
from vmcache.model.saveset import ReadTally, carried_regions, saved_regions

MiB = 1 << 20
P = replace(ModelParams(), block_size=MiB)
NO_HEAT = ActiveHeat(np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros(0, np.float32))


def _counts(pairs: dict[int, float]) -> BlockValues:
    blocks = sorted(pairs)
    return BlockValues(np.array(blocks, np.int64), np.array([pairs[b] for b in blocks], np.float32))


def _heat(pairs: dict[int, float], own: dict[int, float] | None = None) -> ActiveHeat:
    blocks = sorted(pairs)
    own = own if own is not None else pairs
    return ActiveHeat(np.array(blocks, np.int64), np.array([pairs[b] for b in blocks], np.float32),
                      np.array([own.get(b, 0.0) for b in blocks], np.float32))


def test_the_tally_sums_pages_and_halves_them_every_half_life() -> None:
    tally = ReadTally(half_life=100.0)
    tally.add(_counts({3: 10.0, 7: 4.0}), 0.0)
    tally.add(_counts({7: 4.0}), 100.0)
    counts = tally.counts
    assert counts.index.tolist() == [3, 7]
    assert counts.value.tolist() == pytest.approx([5.0, 6.0])
    tally.add(BlockValues.empty(), 50.0)  # a step back in time changes nothing
    assert tally.counts.value.tolist() == pytest.approx([5.0, 6.0])


def test_the_tally_keeps_the_most_read_blocks_when_it_grows_past_twice_its_bound() -> None:
    tally = ReadTally(keep=2)
    tally.add(_counts({1: 5.0, 2: 1.0, 3: 4.0, 4: 3.0}), 0.0)
    assert tally.counts.index.tolist() == [1, 2, 3, 4]  # four: not more than twice the bound
    tally.add(_counts({9: 2.0}), 0.0)
    assert tally.counts.index.tolist() == [1, 3]
    tally.resize(2)
    assert tally.counts.index.tolist() == [1]


def test_the_most_read_blocks_are_saved_whatever_their_heat_and_priority_is_at_least_the_threshold() -> None:
    # blocks 10-11 read most, long ago (no heat left); 40 read less but hot now; the budget holds three
    counts = _counts({10: 50.0, 11: 40.0, 40: 5.0, 70: 1.0})
    regions = saved_regions(counts, _heat({40: 0.9}), P, budget=3 * MiB, size_bytes=100 * MiB)
    assert sorted(r.span for r in regions) == [(10 * MiB, 2 * MiB), (40 * MiB, MiB)]
    prio = {r.start // MiB: r.priority for r in regions}
    assert prio[10] == pytest.approx(2 * P.threshold)  # no heat: the threshold, so a warm start holds it
    assert prio[40] == pytest.approx(0.9)


def test_blocks_not_read_are_ranked_after_the_read_ones_by_their_own_heat() -> None:
    # the guest wrote 60-61 (own heat from the writes it reads back) but read only 20
    heat = _heat({20: 0.3, 59: 0.2, 60: 0.8, 61: 0.6, 62: 0.2}, own={20: 0.3, 60: 0.8, 61: 0.6})
    regions = saved_regions(_counts({20: 3.0}), heat, P, budget=2 * MiB, size_bytes=100 * MiB)
    assert sorted(r.span for r in regions) == [(20 * MiB, MiB), (60 * MiB, MiB)]
    # blocks the Gaussian only warmed (59, 62: no own heat) are no candidates
    regions = saved_regions(BlockValues.empty(), heat, P, budget=10 * MiB, size_bytes=100 * MiB)
    assert sorted(r.span for r in regions) == [(20 * MiB, MiB), (60 * MiB, 2 * MiB)]


def test_gaps_a_warm_start_would_merge_are_counted_against_the_budget() -> None:
    # 0 and 3 are merge_gap (4) apart or less: one region of 4 blocks if both are taken
    counts = _counts({0: 9.0, 3: 8.0, 50: 7.0})
    regions = saved_regions(counts, NO_HEAT, P, budget=4 * MiB, size_bytes=100 * MiB)
    assert [r.span for r in regions] == [(0, 4 * MiB)]
    regions = saved_regions(counts, NO_HEAT, P, budget=3 * MiB, size_bytes=100 * MiB)
    assert [r.span for r in regions] == [(0, MiB)]  # 3 ranks before 50 and does not fit beside 0: the head only
    assert sum(r.length for r in saved_regions(counts, NO_HEAT, P, budget=5 * MiB, size_bytes=100 * MiB)) == 5 * MiB


def test_at_most_max_regions_regions_the_smallest_gaps_closed() -> None:
    p = replace(P, max_regions=2)
    counts = _counts({0: 5.0, 10: 5.0, 12 + 8: 5.0, 40: 5.0})  # gaps 9, 9, 19 blocks
    regions = saved_regions(counts, NO_HEAT, p, budget=100 * MiB, size_bytes=100 * MiB)
    assert sorted(r.span for r in regions) == [(0, 21 * MiB), (40 * MiB, MiB)]
    assert len(saved_regions(counts, NO_HEAT, p, budget=3 * MiB, size_bytes=100 * MiB)) <= 2


def test_the_last_block_ends_at_the_file_and_nothing_past_it_is_saved() -> None:
    counts = _counts({98: 2.0, 99: 2.0, 150: 9.0})
    regions = saved_regions(counts, NO_HEAT, P, budget=10 * MiB, size_bytes=99 * MiB + 4096)
    assert [r.span for r in regions] == [(98 * MiB, MiB + 4096)]
    assert saved_regions(counts, NO_HEAT, P, budget=MiB - 1, size_bytes=100 * MiB) == []
    assert saved_regions(BlockValues.empty(), NO_HEAT, P, budget=MiB, size_bytes=100 * MiB) == []
    with pytest.raises(ValueError):
        saved_regions(counts, NO_HEAT, P, budget=-1, size_bytes=100 * MiB)


def test_a_cycle_tallies_the_reads_it_counts() -> None:
    n = 100
    cycle = Cycle(P, n)
    none = BlockValues.empty()
    cycle.step(none, none, [], size_bytes=n * MiB, budget=8 * MiB, now=10.0,
               reads=GuestReads(_counts({5: 8.0}), none))
    cycle.step(none, none, [], size_bytes=n * MiB, budget=8 * MiB, now=20.0,
               reads=GuestReads(_counts({6: 2.0}), none))
    cycle.step(none, none, [], size_bytes=n * MiB, budget=8 * MiB, now=30.0)  # nothing counted: nothing added
    assert cycle.tally.counts.index.tolist() == [5, 6]
    assert cycle.tally.counts.value.tolist() == pytest.approx([8.0, 2.0], rel=1e-3)


def test_what_a_migration_carries_is_a_zone_read_for_a_minute_before_one_read_for_hours() -> None:
    """The guest read blocks 0-3 every 2 s for three hours, then moved to blocks 50-53 a minute before the
    save: the most-read ranking still saves the old zone, what a migration carries the new."""
    tally = ReadTally()
    t = 0.0
    while t < 3 * 3600:
        tally.add(_counts({b: 8.0 for b in range(4)}), t)
        t += 2.0
    moved = t
    while t < moved + 60:
        tally.add(_counts({b: 8.0 for b in range(50, 54)}), t)
        t += 2.0
    tally.add(BlockValues.empty(), t)
    most = saved_regions(tally.counts, NO_HEAT, P, budget=4 * MiB, size_bytes=100 * MiB)
    now = carried_regions(tally, NO_HEAT, P, budget=4 * MiB, size_bytes=100 * MiB)
    assert [r.span for r in most] == [(0, 4 * MiB)]
    assert [r.span for r in now] == [(50 * MiB, 4 * MiB)]
    # room for both: the new zone first, then the old by its tally
    both = carried_regions(tally, NO_HEAT, P, budget=8 * MiB, size_bytes=100 * MiB)
    assert sorted(r.span for r in both) == [(0, 4 * MiB), (50 * MiB, 4 * MiB)]


def test_a_migration_carries_only_blocks_the_guest_goes_back_to_not_pages_it_read_once() -> None:
    """Blocks 0-3: read over and over (hits once cached); 20-27: each page read once, every read a miss (a web
    server's new files); 40: a scan whose readahead brought in more than it read. Only 0-3 are carried,
    whatever the budget, while the start's set (the most read) takes them all."""
    tally = ReadTally()
    for k in range(30):
        t = 2.0 * k
        tally.add(_counts({0: 64.0, 1: 64.0, 2: 64.0, 3: 64.0}), t, _counts({0: 64.0, 1: 64.0, 2: 64.0, 3: 64.0})
                  if k == 0 else None)
        once = {20 + k % 8: 32.0, 40: 16.0}
        tally.add(_counts(once), t + 1, _counts({20 + k % 8: 32.0, 40: 32.0}))
    carried = carried_regions(tally, NO_HEAT, P, budget=64 * MiB, size_bytes=100 * MiB)
    assert [r.span for r in carried] == [(0, 4 * MiB)]
    saved = saved_regions(tally.counts, NO_HEAT, P, budget=64 * MiB, size_bytes=100 * MiB)
    assert sum(r.length for r in saved) >= 13 * MiB
    # a page read twice proves as much as it costs, not more: a block half hits is not carried
    half = ReadTally()
    half.add(_counts({7: 10.0}), 0.0, _counts({7: 5.0}))
    assert carried_regions(half, NO_HEAT, P, budget=8 * MiB, size_bytes=100 * MiB) == []
    half.add(_counts({7: 2.0}), 1.0)
    assert [r.span for r in carried_regions(half, NO_HEAT, P, budget=8 * MiB, size_bytes=100 * MiB)] == [(7 * MiB, MiB)]


def test_where_reads_are_not_counted_a_migration_carries_the_blocks_with_heat_of_their_own() -> None:
    heat = _heat({20: 0.3, 59: 0.2, 60: 0.8}, own={20: 0.3, 60: 0.8})
    tally = ReadTally()
    assert not tally.counted
    regions = carried_regions(tally, heat, P, budget=10 * MiB, size_bytes=100 * MiB)
    assert sorted(r.span for r in regions) == [(20 * MiB, MiB), (60 * MiB, MiB)]
    tally.add(BlockValues.empty(), 0.0)  # counted, nothing read: nothing proven, nothing carried
    assert tally.counted
    assert carried_regions(tally, heat, P, budget=10 * MiB, size_bytes=100 * MiB) == []


def test_blocks_not_read_now_keep_their_tally_s_order_behind_those_read_now() -> None:
    tally = ReadTally()
    tally.add(_counts({1: 50.0, 2: 40.0, 3: 30.0}), 0.0)
    tally.add(_counts({9: 2.0}), 3600.0)  # an hour on: 1-3 are long out of the recent count
    assert tally.reused(recent=True).index.tolist() == [9]
    assert tally.reused(recent=False).index.tolist() == [1, 2, 3, 9]
    regions = carried_regions(tally, NO_HEAT, P, budget=3 * MiB, size_bytes=100 * MiB)
    assert sorted(r.span for r in regions) == [(1 * MiB, 2 * MiB), (9 * MiB, MiB)]


def test_a_cycle_tallies_which_of_the_reads_it_counts_were_hits() -> None:
    n = 100
    cycle = Cycle(P, n)
    none = BlockValues.empty()
    cycle.step(none, none, [], size_bytes=n * MiB, budget=8 * MiB, now=10.0,
               reads=GuestReads(_counts({5: 8.0, 6: 8.0}), _counts({5: 8.0, 6: 1.0})))
    assert cycle.tally.reused(recent=True).index.tolist() == [6]  # 5: every page a miss
    assert cycle.tally.reused(recent=False).index.tolist() == [6]


def test_a_warm_start_s_blocks_the_guest_has_not_read_yet_are_carried_after_the_proven_ones() -> None:
    """Restored and not read yet (a guest paused, or migrated right after its start): still a start's bet,
    carried behind the blocks with proven reuse, by own heat."""
    tally = ReadTally()
    tally.add(_counts({3: 8.0}), 0.0)  # hits only: proven
    heat = _heat({20: 0.5, 30: 0.9}, own={20: 0.5, 30: 0.9})
    unjudged = np.array([20, 30], np.int64)
    regions = carried_regions(tally, heat, P, budget=2 * MiB, size_bytes=100 * MiB, unjudged=unjudged)
    assert sorted(r.span for r in regions) == [(3 * MiB, MiB), (30 * MiB, MiB)]
    assert [r.span for r in carried_regions(tally, heat, P, budget=8 * MiB, size_bytes=100 * MiB)] == [(3 * MiB, MiB)]
