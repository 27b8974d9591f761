"""Cycle: the per-disk cycle the engine, the replay and the planner tests all run (pure)."""

from __future__ import annotations

import numpy as np

from vmcache.model.cycle import Cycle, blocks_mask, evidence_per_block
from vmcache.model.params import ModelParams
from vmcache.model.region import Region

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
    c = Cycle(P, N, prefetch_rate=4 * BS)  # 4 uncached blocks per second
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


def test_helpers() -> None:
    mask = blocks_mask([Region(BS + 1, 10), Region(5 * BS, 2 * BS)], BS, 8)
    assert mask.tolist() == [False, True, False, False, False, True, True, False]
    assert evidence_per_block(0) == 16 and evidence_per_block(1024) == 4 and evidence_per_block(10**6) == 1
