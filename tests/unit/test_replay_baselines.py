"""Replay measures and baselines: costly accesses, the kernel-like lists, the read-aware optimum (pure)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from vmcache.replay import baselines
from vmcache.replay.accesses import BlockTrace, to_blocks
from vmcache.replay.baselines import LinuxCache
from vmcache.replay.measures import measure
from vmcache.replay.trace import Trace

BS = 64 << 10


def trace(ops: list[tuple[str, int, int]]) -> Trace:
    return Trace.from_lists([float(i) for i in range(len(ops))], [op == "W" for op, _, _ in ops],
                            [off for _, off, _ in ops], [ln for _, _, ln in ops])


def test_partial_page_writes_are_costly_where_their_partial_pages_lie() -> None:
    bt = to_blocks(trace([("R", 0, 4096), ("W", 4096, 8192), ("W", BS - 512, 1024), ("W", 3 * BS + 100, 50)]), BS)
    assert bt.block.tolist() == [0, 0, 0, 1, 3]
    assert bt.costly.tolist() == [True, False, True, True, True]  # the read; the unaligned write's both units
    assert bt.pages.tolist() == [1, 2, 1, 1, 1]
    assert bt.request.tolist() == [0, 1, 2, 2, 3]
    hit = np.array([False, True, False, False, False])
    r = measure("x", 0, bt, hit)
    assert (r.requests, r.device_reads, r.read_accesses, r.read_hits) == (4, 4, 1, 0)
    assert r.reads_per_request == 1.0


def run(cache: baselines.Rest, ops: list[tuple[int, bool]]) -> list[bool]:
    return [cache.access(unit, write) for unit, write in ops]


def test_linux_keeps_a_page_read_twice_through_a_one_pass_read() -> None:
    ops = [(1, False), (1, False)] + [(10 + i, False) for i in range(20)] + [(1, False)]
    assert run(LinuxCache(4, unit_bytes=BS), ops)[-1]  # activated: the scan passes through the inactive list
    assert not run(baselines.LruCache(4), ops)[-1]


def test_linux_writes_do_not_activate() -> None:
    ops = [(1, True), (1, True), (1, True)] + [(10 + i, False) for i in range(20)] + [(1, False)]
    assert not run(LinuxCache(4, unit_bytes=BS), ops)[-1]


def test_linux_two_marks_activate_a_written_unit_and_a_mark_never_loads() -> None:
    stream = [(10 + i, False) for i in range(20)]
    cache = LinuxCache(4, unit_bytes=BS)
    run(cache, [(1, True), (2, True)])
    assert cache.mark(1) and cache.mark(1) and cache.is_active(1)
    assert not cache.mark(7) and 7 not in cache  # not resident: left alone (no device read)
    assert [hit for hit in run(cache, [*stream, (1, False), (2, False)])][-2:] == [True, False]


def test_linux_refresh_moves_an_inactive_unit_to_the_head_without_activating_it() -> None:
    cache = LinuxCache(3, unit_bytes=BS)
    run(cache, [(1, True), (2, True), (3, True)])  # inactive, tail first: 1, 2, 3
    cache.refresh([1, 9])  # 9 is not cached: left alone
    assert cache.inactive_units() == [2, 3, 1] and not cache.is_active(1) and 9 not in cache
    run(cache, [(4, True)])  # the tail goes: 2, not the refreshed 1
    assert 1 in cache and 2 not in cache


def test_linux_refault_within_the_active_size_comes_back_active() -> None:
    cache = LinuxCache(4, unit_bytes=BS)
    run(cache, [(1, False), (1, False), (2, False), (2, False)])  # 1, 2 active
    run(cache, [(3, False), (4, False), (5, False)])  # 3 evicted from the inactive tail
    assert 3 not in cache and cache.active_units == 2
    run(cache, [(3, False)])  # refault at distance 1 (one eviction since) <= 2 active: back on the active list
    assert cache.is_active(3)
    fresh = LinuxCache(4, unit_bytes=BS)
    run(fresh, [(3, False)])
    assert 3 in fresh and not fresh.is_active(3)


def test_linux_pin_and_release() -> None:
    cache = LinuxCache(4, unit_bytes=BS)
    run(cache, [(1, False), (2, False)])
    assert cache.discard(1) and not cache.discard(9) and 1 not in cache
    cache.release(9)
    assert 9 in cache and len(cache) == 2


def test_belady_does_not_keep_what_a_full_write_replaces() -> None:
    block = np.array([1, 2, 1, 2, 1], dtype=np.int64)
    write = np.array([False, False, True, False, False])
    bt = BlockTrace.aligned(block, np.arange(5.0), write, BS, 3)
    # capacity 1: keeping 1 until its write saves nothing; keeping 2 saves its read at 3
    assert baselines.belady(bt, 1).tolist() == [False, False, False, True, False]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.booleans(), st.booleans()), min_size=1, max_size=80),
       st.integers(1, 10))
def test_read_aware_optimum_bounds_the_device_reads(ops: list[tuple[int, bool, bool]], capacity: int) -> None:
    n = len(ops)
    block = np.array([b for b, _, _ in ops], dtype=np.int64)
    write = np.array([w for _, w, _ in ops])
    costly = np.array([(not w) or partial for _, w, partial in ops])
    bt = BlockTrace(block, np.arange(float(n)), write, BS, 10, np.ones(n, np.int32), costly, np.arange(n))
    best = measure("b", 0, bt, baselines.belady(bt, capacity)).device_reads
    for policy in (baselines.lru, baselines.linux, baselines.static_topk):
        assert best <= measure("p", 0, bt, policy(bt, capacity)).device_reads
