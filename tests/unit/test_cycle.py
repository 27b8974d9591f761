"""Cycle: the per-disk cycle the engine, the replay and the planner tests all run (pure)."""

from __future__ import annotations

import numpy as np

from vmcache.model import pindiff
from vmcache.model.blocks import BlockValues, blocks_mask
from vmcache.model.cycle import Cycle, evidence_per_block
from vmcache.model.params import ModelParams
from vmcache.model.reads import GuestReads
from vmcache.model.region import Region
from vmcache.model.warm import WarmStart

BS = 64 * 1024
N = 100
P = ModelParams(block_size=BS, interval=1.0, threshold=0.2)


def zeros() -> np.ndarray:
    return np.zeros(N, np.float32)


def test_read_misses_count_growth_that_is_neither_ours_nor_written() -> None:
    c = Cycle(P, N)
    first = zeros()
    first[10:20] = 1.0
    assert c.step(first, zeros(), [], size_bytes=N * BS, budget=0, now=1.0).read_miss_bytes == 0  # no baseline
    c.pinned([Region(10 * BS, 10 * BS)])
    grown = first.copy()
    grown[30:34] = 1.0   # the guest read 4 blocks
    grown[50:52] = 1.0   # and wrote 2
    written = zeros()
    written[50:52] = 1.0
    result = c.step(grown, written, [Region(10 * BS, 10 * BS)], size_bytes=N * BS, budget=0, now=2.0)
    assert result.read_miss_bytes == 4 * BS


def test_a_block_stays_ours_until_evicted() -> None:
    c = Cycle(P, N)
    resident = zeros()
    resident[40:44] = 1.0
    c.step(resident, zeros(), [Region(40 * BS, 4 * BS)], size_bytes=N * BS, budget=0, now=1.0)
    assert c.ours[40:44].all()
    c.step(resident, zeros(), [], size_bytes=N * BS, budget=0, now=2.0)  # released, still resident
    assert c.ours[40:44].all()
    resident[40:42] = 0.0  # evicted
    c.step(resident, zeros(), [], size_bytes=N * BS, budget=0, now=3.0)
    assert not c.ours[40:42].any() and c.ours[42:44].all()


def test_resize_keeps_what_survives() -> None:
    c = Cycle(P, N)
    c.pinned([Region(90 * BS, 10 * BS)])
    assert c.resize(95) and c.nblocks == 95 and c.ours[90:].all()
    assert not c.resize(95)


def test_prefetch_limit_holds_back_cold_new_regions_until_paid() -> None:
    # 4 uncached blocks per second; these residencies count whole blocks, so the load gate is not in play
    c = Cycle(P, N, prefetch_rate=4 * BS, residency_unit=BS)
    resident = zeros()
    written = zeros()
    written[20:28] = 1.0
    waits = []
    regions: list[Region] = []
    for t in range(1, 8):
        result = c.step(resident, written, regions, size_bytes=N * BS, budget=N * BS, now=float(t))
        waits.append(result.waiting)
        regions = result.regions
        c.pinned(regions)
    assert waits[0] == 1  # planned at once, but 8+ cold blocks cost more than one second's tokens
    assert any(r.start <= 20 * BS and r.end >= 28 * BS for r in regions)


def test_under_recharge_the_prefetch_limit_pays_for_a_new_region_s_cached_bytes_too() -> None:
    """A pin read in by the agent (QEMU under a limit the agent is not) reads its cached pages again."""
    def first_plan(recharge: bool) -> list[Region]:
        c = Cycle(P, N, prefetch_rate=4 * BS, residency_unit=BS)
        resident, written = zeros(), zeros()
        resident[20:28] = written[20:28] = 1.0  # written and cached whole: free to pin, unless read again
        return c.step(resident, written, [], size_bytes=N * BS, budget=N * BS, now=1.0, recharge=recharge).regions

    assert sum(r.length for r in first_plan(False)) == 8 * BS
    assert sum(r.length for r in first_plan(True)) == 4 * BS  # one second's tokens: the rest waits


def test_helpers() -> None:
    mask = blocks_mask([Region(BS + 1, 10), Region(5 * BS, 2 * BS)], BS, 8)
    assert mask.tolist() == [False, True, False, False, False, True, True, False]
    assert evidence_per_block(0) == 16 and evidence_per_block(1024) == 4 and evidence_per_block(10**6) == 1


# -- chunked prefetch: a large region is loaded piece by piece ------------------------

MiB = 1 << 20
WARM_P = ModelParams(block_size=MiB, interval=10.0)
DISK = 2048  # blocks: a 2 GiB image


def apply(pins: dict[tuple[int, int], Region], plan: list[Region], budget: int) -> dict[tuple[int, int], Region]:
    """What the pinner does with a plan (vmcache.model.pindiff, plenty of memory): the pins after it."""
    wanted = pindiff.clip(plan, DISK * MiB)
    stale, overlapping = pindiff.unplanned(pins, wanted)
    pins = {s: r for s, r in pins.items() if s not in stale}
    todo = pindiff.diff(pins, wanted, overlapping, budget=budget, headroom=1 << 40)
    after = {s: r for s, r in pins.items() if s not in todo.release}
    after.update(todo.keep)
    for addition in todo.add:
        for span in addition.replaces:
            after.pop(span, None)
        after[addition.region.span] = addition.region
    for span in todo.orphans:
        after.pop(span, None)
    return after


def restore(saved: list[tuple[Region, float]], *, budget: int, rate: int | None = 8 * MiB,
            warm_rate: int | None = None, cycles: int = 6) -> tuple[list[dict[tuple[int, int], Region]], WarmStart]:
    """Warm-start a cold disk from ``saved`` (the guest reads nothing); the pins after each 10 s cycle."""
    c = Cycle(WARM_P, DISK, prefetch_rate=rate, warm_rate=warm_rate)
    c.warm = WarmStart(saved, WARM_P)
    pins: dict[tuple[int, int], Region] = {}
    history = []
    for k in range(cycles):
        resident = blocks_mask(pins.values(), MiB, DISK).astype(np.float32)  # only what is pinned is cached
        result = c.step(resident, np.zeros(DISK, np.float32), list(pins.values()), size_bytes=DISK * MiB,
                        budget=budget, now=10.0 * k)
        pins = apply(pins, result.regions, budget)
        c.pinned(pins.values())
        history.append(pins)
    return history, c.warm


def total(pins: dict[tuple[int, int], Region]) -> int:
    return sum(length for _, length in pins)


def _restored_then_unread(read_from: int | None, cycles: int = 60) -> list[int]:
    """A saved 8 MiB region restored on the exact path, the guest reading nothing (its first block from cycle
    ``read_from``, 16 pages a cycle): the MiB pinned after each 10 s cycle."""
    c = Cycle(WARM_P, DISK, prefetch_rate=8 * MiB)
    c.warm = WarmStart([(Region(0, 8 * MiB), 1.0)], WARM_P)
    pins: dict[tuple[int, int], Region] = {}
    nothing, history = np.zeros(DISK, np.float32), []
    for k in range(cycles):
        read = read_from is not None and k >= read_from
        reads = GuestReads(BlockValues(np.arange(1 if read else 0), np.full(1 if read else 0, 16, np.float32)),
                           BlockValues.empty())
        resident = blocks_mask(pins.values(), MiB, DISK).astype(np.float32)
        result = c.step(resident, nothing, list(pins.values()), size_bytes=DISK * MiB, budget=64 * MiB,
                        now=10.0 * k, reads=reads)
        pins = apply(pins, result.regions, 64 * MiB)
        c.pinned(pins.values())
        history.append(total(pins) // MiB)
    return history


def test_with_counted_reads_a_restored_set_the_guest_has_not_read_is_held_as_a_pinned_one() -> None:
    """Counted reads cool an unread block at ``decay`` (0.9 a cycle: a heat of 1 is let go in ~22 cycles); a
    restored block is held at ``pinned_decay`` (0.98) until the guest reads it, as the inferred path holds a
    resident pinned one, so a set restored ahead of a slow boot is still there 10 minutes on."""
    history = _restored_then_unread(None)
    assert history[0] == 8 and min(history) == 8  # all 60 cycles
    # a block the guest reads is the model's again: read at 16 pages a cycle, it keeps its pin, and the others
    # still hold theirs
    assert min(_restored_then_unread(5)[5:]) == 8


def test_a_large_saved_region_is_restored_in_steps_of_one_interval_of_prefetch() -> None:
    # the bench's cold boot: one 248 MiB saved region, 8 MiB/s, 10 s cycles, 256 MiB budget
    history, warm = restore([(Region(0, 248 * MiB), 1.0)], budget=256 * MiB)
    assert [total(p) // MiB for p in history] == [80, 160, 240, 248, 248, 248]
    assert [sorted(p) for p in history[:4]] == [[(0, 80 * MiB)], [(0, 160 * MiB)], [(0, 240 * MiB)],
                                                [(0, 248 * MiB)]]  # one pin, grown from the start
    assert warm.done and warm.restored_bytes == 248 * MiB


def test_a_partly_restored_region_counts_as_partly_restored() -> None:
    history, warm = restore([(Region(0, 248 * MiB), 1.0)], budget=256 * MiB, cycles=2)
    assert total(history[-1]) == 160 * MiB
    assert not warm.done and warm.restored_bytes == 160 * MiB and warm.pending_bytes == 88 * MiB


def test_chunks_follow_priority_and_never_pass_the_budget() -> None:
    saved = [(Region(1024 * MiB, 100 * MiB), 0.5), (Region(0, 120 * MiB), 1.0), (Region(512 * MiB, 60 * MiB), 0.9)]
    history, warm = restore(saved, budget=200 * MiB, cycles=8)
    assert all(total(p) <= 200 * MiB for p in history)
    # the hottest region first (two steps), then the next by priority; never a lower one before a higher one
    assert sorted(history[0]) == [(0, 80 * MiB)]
    assert sorted(history[1]) == [(0, 120 * MiB), (512 * MiB, 40 * MiB)]
    # the planner trims the last region to what the budget leaves (20 MiB of its 100)
    assert sorted(history[2]) == [(0, 120 * MiB), (512 * MiB, 60 * MiB), (1024 * MiB, 20 * MiB)]
    assert sorted(history[-1]) == sorted(history[2])


def test_the_bucket_holds_one_interval_not_the_budget() -> None:
    # a quiet start (nothing to pin for a minute) must not save up the budget for one burst
    c = Cycle(WARM_P, DISK, prefetch_rate=8 * MiB)
    nothing = np.zeros(DISK, np.float32)
    for k in range(6):
        c.step(nothing, nothing, [], size_bytes=DISK * MiB, budget=256 * MiB, now=10.0 * k)
    written = nothing.copy()
    written[0:200] = 1.0  # 200 MiB of the guest's writes: hot, but not in the cache
    pins: list[Region] = []
    for k in range(6, 12):
        pins = c.step(nothing, written, pins, size_bytes=DISK * MiB, budget=256 * MiB, now=10.0 * k).regions
        c.pinned(pins)
        if pins:
            break
    assert sum(r.length for r in pins) <= 80 * MiB  # one interval's worth of 8 MiB/s


def test_a_warm_rate_applies_only_while_the_saved_set_is_restored() -> None:
    history, warm = restore([(Region(0, 248 * MiB), 1.0)], budget=256 * MiB, warm_rate=16 * MiB, cycles=3)
    assert [total(p) // MiB for p in history] == [160, 248, 248]
    assert warm.done
    # once restored, new heat is paid for at prefetch_rate again: 80 MiB a cycle, not 160 (whole blocks: the
    # load gate, which would hold back written blocks not cached, is not in play)
    c = Cycle(WARM_P, DISK, prefetch_rate=8 * MiB, warm_rate=16 * MiB, residency_unit=MiB)
    c.warm = WarmStart([(Region(0, 8 * MiB), 1.0)], WARM_P)
    nothing = np.zeros(DISK, np.float32)
    pins = c.step(nothing, nothing, [], size_bytes=DISK * MiB, budget=512 * MiB, now=0.0).regions
    c.pinned(pins)
    assert c.warm.done
    written = nothing.copy()
    written[1024:1224] = 1.0  # 200 MiB the guest wrote, not cached
    resident = blocks_mask(pins, MiB, DISK).astype(np.float32)
    for k in (1, 2, 3):
        pins = c.step(resident, written, pins, size_bytes=DISK * MiB, budget=512 * MiB, now=10.0 * k).regions
        c.pinned(pins)
        resident = blocks_mask(pins, MiB, DISK).astype(np.float32)
        new = sum(r.length for r in pins if r.start >= 1024 * MiB)
        if new:
            break
    assert new == 80 * MiB, new
    # lower than prefetch_rate: the higher of the two applies
    history, _ = restore([(Region(0, 248 * MiB), 1.0)], budget=256 * MiB, warm_rate=1 * MiB, cycles=1)
    assert total(history[0]) == 80 * MiB
    # unlimited prefetch: all at once
    history, _ = restore([(Region(0, 248 * MiB), 1.0)], budget=256 * MiB, rate=None, cycles=1)
    assert total(history[0]) == 248 * MiB
