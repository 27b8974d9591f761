"""The sparse model and planner against the dense reference: same heat, same plans, cycle after cycle."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit import dense_reference as dense
from vmcache.model.blocks import BlockValues, blocks_of, dilate
from vmcache.model.heat import DROP_SHARE, HeatModel
from vmcache.model.params import ModelParams
from vmcache.model.planner import plan, plan_active
from vmcache.model.region import Region

BS = 64 << 10


def _scenario(rng: np.random.Generator, n: int, cycles: int):
    """Inputs of a guest: a few ranges and scattered blocks, pins from the plan, evidence, idle spells."""
    ranges = [(int(s), int(s) + int(rng.integers(1, 40))) for s in rng.integers(0, n, 6)]
    for cycle in range(cycles):
        res = np.zeros(n, np.float32)
        wr = np.zeros(n, np.float32)
        if cycle % 17 < 12:  # busy, then idle for a while: untouched heat decays
            for s, e in ranges[: int(rng.integers(1, len(ranges) + 1))]:
                res[s:e] = rng.choice([1.0, 0.5, 0.25])
            res[rng.integers(0, n, 30)] = rng.random(30).astype(np.float32)
            wr[rng.integers(0, n, 10)] = rng.random(10).astype(np.float32)
            if rng.random() < 0.3:
                s, e = ranges[int(rng.integers(0, len(ranges)))]
                wr[s:e] = 0.5
        res[0] = rng.random() < 0.3   # the disk's edges
        res[-1] = rng.random() < 0.3
        yield res, wr


@pytest.mark.parametrize("forget", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_sparse_heat_and_plans_equal_the_dense_reference(seed: int, forget: bool) -> None:
    """Bit for bit when no block is forgotten; with forgetting within twice the drop level, same plans."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(50, 3000))
    p = ModelParams(block_size=BS, read_sigma=float(rng.choice([0.0, 1.0, 2.0, 5.5])),
                    write_sigma=float(rng.choice([0.0, 2.0, 8.0])), decay=0.8, pinned_decay=0.95,
                    max_regions=int(rng.integers(2, 40)))
    budget = int(rng.integers(1, n // 3 + 2)) * BS
    sparse = HeatModel(p, n, drop_share=DROP_SHARE if forget else 0.0)
    ref = dense.HeatModel(p, n)
    ours = np.zeros(n, bool)
    current: list[Region] = []
    drop = DROP_SHARE * p.threshold / p.keep_factor if forget else 0.0
    now = 0.0
    for res, wr in _scenario(rng, n, 120):
        seen = np.full(n, np.nan, np.float32)
        pinned = np.zeros(n, bool)
        for r in current:
            pinned[r.start // BS : -(-r.end // BS)] = True
        if seed % 2:  # with read evidence of the pinned blocks, as root has
            seen[pinned] = (rng.random(int(pinned.sum())) < 0.3).astype(np.float32)
        ours = (ours & (res > 0)) | pinned
        now += float(rng.choice([p.interval, p.interval / 2, 3 * p.interval]))
        got = sparse.step(res, wr, ours, now, seen=seen)
        want = ref.step(res, wr, ours, now, seen=seen)
        np.testing.assert_allclose(got, want, rtol=0, atol=2 * drop)  # forgotten, then warmed a little
        np.testing.assert_allclose(sparse.own, ref.own, rtol=0, atol=2 * drop)
        size = n * BS - int(rng.integers(0, BS))
        wanted = dense.plan(want, params=p, size_bytes=size, budget=budget, current=current, own=ref.own)
        for planned in (plan_active(sparse.active, params=p, size_bytes=size, budget=budget, current=current),
                        plan(got, params=p, size_bytes=size, budget=budget, current=current, own=sparse.own)):
            if forget:  # the same regions; priorities may miss the forgotten crumbs
                assert [r.span for r in planned] == [r.span for r in wanted]
                assert [r.priority for r in planned] == pytest.approx([r.priority for r in wanted], rel=1e-4)
            else:
                assert planned == wanted
        current = wanted


def test_a_huge_sparse_disk_costs_what_its_touched_blocks_cost() -> None:
    """64 TiB of 1 MiB blocks: 2**26 blocks, of which 100 are touched; no array over the disk."""
    p = ModelParams()
    n = 1 << 26
    m = HeatModel(p, n)
    hot = np.arange(n - 50, n, dtype=np.int64)
    res = BlockValues(np.concatenate((np.arange(1000, 1050), hot)), np.ones(100, np.float32))
    for k in range(30):
        active = m.step_blocks(res, BlockValues.empty(), np.zeros(0, np.int64), k * p.interval)
    assert active.blocks.size < 200
    regions = plan_active(active, params=p, size_bytes=n * p.block_size, budget=1 << 30)
    assert sorted((r.start // p.block_size, r.end // p.block_size) for r in regions) == [(1000, 1050), (n - 50, n)]
    # once the guest is gone, the heat fades and the blocks are forgotten
    for k in range(30, 400):
        active = m.step_blocks(BlockValues.empty(), BlockValues.empty(), np.zeros(0, np.int64), k * p.interval)
    assert active.blocks.size == 0


def test_step_blocks_refuses_unsorted_repeated_or_outside_blocks() -> None:
    m = HeatModel(ModelParams(), 100)
    none = np.zeros(0, np.int64)
    for bad in ([3, 2], [2, 2], [-1], [100]):
        with pytest.raises(ValueError, match="residency"):
            m.step_blocks(BlockValues(np.array(bad, np.int64), np.ones(len(bad), np.float32)),
                          BlockValues.empty(), none, 0.0)
    with pytest.raises(ValueError, match="ours"):
        m.step_blocks(BlockValues.empty(), BlockValues.empty(), np.array([100]), 0.0)


def test_dilate_joins_runs_that_grow_into_each_other_and_stays_on_the_disk() -> None:
    got = dilate(np.array([0, 5, 6, 20], np.int64), 2, 22)
    assert got.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 18, 19, 20, 21]
    assert dilate(np.zeros(0, np.int64), 3, 10).size == 0


def test_binned_takes_the_mean_or_the_largest_and_a_short_last_bin_is_its_own_mean() -> None:
    from vmcache.model.blocks import binned

    values = BlockValues(np.array([0, 1, 5, 9], np.int64), np.array([1.0, 0.5, 0.25, 1.0], np.float32))
    assert binned(values, 4, 10).tolist() == [0.375, 0.0625, 0.5]
    assert binned(values, 4, 10, hottest=True).tolist() == [1.0, 0.25, 1.0]
    np.testing.assert_array_equal(binned(values, 1, 10), values.to_dense(10))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 60 * 4096), st.integers(0, 12 * 4096)), max_size=6),
       st.sampled_from([4096, 3 * 4096]), st.integers(0, 80))
def test_blocks_of_is_every_block_a_region_touches(spans: list[tuple[int, int]], block_size: int,
                                                   nblocks: int) -> None:
    regions = [Region(start, length, 1.0) for start, length in spans]
    want = sorted({b for r in regions if r.length > 0
                   for b in range(r.start // block_size, -(-r.end // block_size)) if b < nblocks})
    assert blocks_of(regions, block_size, nblocks).tolist() == want
