"""Cycle.step with the guest's reads counted exactly (GuestReads): no inference from residency (pure)."""

from __future__ import annotations

import numpy as np

from vmcache.model.blocks import BlockValues
from vmcache.model.cycle import Cycle
from vmcache.model.exact import PinShare, ReadBack
from vmcache.model.params import PAGE_SIZE, ModelParams
from vmcache.model.reads import GuestReads
from vmcache.model.region import Region

BS = 64 * 1024
N = 100
PAGES = BS // PAGE_SIZE
P = ModelParams(block_size=BS, interval=1.0, threshold=0.2)


def cycle(n: int = N) -> Cycle:
    """A cycle whose residency counts whole blocks: these tests give reads without the pages they cached, so
    the load gate (tests/unit/test_loadgate.py), which reads the guest's reach from residency, is not in play."""
    return Cycle(P, n, residency_unit=BS)


def listed(blocks: range, value: float) -> BlockValues:
    index = np.arange(blocks.start, blocks.stop, dtype=np.int64)
    return BlockValues(index, np.full(index.size, value, np.float32))


def step(c: Cycle, reads: GuestReads, now: float, pinned: list[Region], *, resident: BlockValues | None = None,
         budget: int = 8 * BS) -> list[Region]:
    res = resident if resident is not None else BlockValues.empty()
    return c.step(res, BlockValues.empty(), pinned, size_bytes=N * BS, budget=budget, now=now, reads=reads).regions


def test_read_misses_are_the_counted_ones() -> None:
    c = cycle()
    reads = GuestReads(listed(range(10, 14), PAGES), listed(range(10, 12), 3))
    result = c.step(listed(range(0, 50), 1.0), BlockValues.empty(), [], size_bytes=N * BS, budget=0, now=1.0,
                    reads=reads)
    assert result.read_miss_bytes == 2 * 3 * PAGE_SIZE


def test_blocks_read_are_pinned_and_residency_alone_heats_nothing() -> None:
    c = cycle()
    pinned: list[Region] = []
    for t in range(1, 8):  # blocks 60-80 resident (a backup's pages), only 20-24 read
        pinned = step(c, GuestReads(listed(range(20, 24), PAGES), GuestReads.empty().missed), float(t), pinned,
                      resident=listed(range(60, 80), 1.0))
    assert pinned == [Region(20 * BS, 4 * BS, pinned[0].priority)]


def test_a_pinned_block_nobody_reads_cools_at_the_normal_decay() -> None:
    c = cycle()
    pinned: list[Region] = []
    hot = GuestReads(listed(range(20, 24), PAGES // 4), BlockValues.empty())  # input 1 (seen_scale 4)
    for t in range(1, 8):
        pinned = step(c, hot, float(t), pinned)
    assert pinned
    # unread from now on: no hold (pinned_decay) - released once the heat is under threshold / keep_factor,
    # ln(0.1 / h) / ln(0.9) cycles at the normal decay, where the hold of the inferred path takes ~5x longer
    held = 0
    for t in range(8, 60):
        pinned = step(c, GuestReads.empty(), float(t), pinned)
        held += bool(pinned)
    assert not pinned and held < 15


def test_a_pinned_block_the_guest_keeps_reading_stays_pinned() -> None:
    c = cycle()
    pinned: list[Region] = []
    for t in range(1, 60):  # a quarter of the block's pages read per cycle: all hits once pinned
        pinned = step(c, GuestReads(listed(range(20, 24), PAGES // 4), BlockValues.empty()), float(t), pinned)
    assert pinned == [Region(20 * BS, 4 * BS, pinned[0].priority)]


def test_a_one_pass_read_is_never_pinned() -> None:
    """A backup streaming through the disk reads each block in full, once: one cycle of input, under the threshold."""
    c = cycle()
    pinned: list[Region] = []
    for t in range(1, N // 4):
        stream = range(4 * (t - 1), 4 * t)
        pinned = step(c, GuestReads(listed(stream, PAGES), listed(stream, PAGES)), float(t), pinned)
        assert not pinned


def test_a_slow_guest_s_hot_zone_is_pinned() -> None:
    """20 reads a cycle, 90% in 16 of 4000 blocks: a page per hot block per cycle, judged against the guest's rate."""
    n = 4000
    c = cycle(n)
    rng = np.random.default_rng(5)
    pinned: list[Region] = []
    for t in range(1, 15):
        hot = rng.random(20) < 0.9
        blocks = np.where(hot, rng.integers(100, 116, 20), rng.integers(0, n, 20))
        index, counts = np.unique(blocks, return_counts=True)
        reads = GuestReads(BlockValues(index.astype(np.int64), counts.astype(np.float32)), BlockValues.empty())
        pinned = c.step(BlockValues.empty(), BlockValues.empty(), pinned, size_bytes=n * BS, budget=32 * BS,
                        now=float(t), reads=reads).regions
    taken = {b for r in pinned for b in range(r.start // BS, r.end // BS)}
    assert len(taken & set(range(100, 116))) >= 12 and len(taken - set(range(100, 116))) <= 4


def test_read_back_share_follows_what_the_guest_reads_again() -> None:
    rb = ReadBack(horizon=3, memory=10)
    blocks = np.arange(10, dtype=np.int64)
    none = np.zeros(0, dtype=np.int64)
    for _ in range(20):  # written, never read: each write expires unread after 3 cycles
        rb.update(blocks, none)
    assert rb.share < 0.05
    for _ in range(20):  # written, then read the next cycle
        rb.update(blocks, blocks)
    assert rb.share > 0.95


def test_writes_nobody_reads_back_are_not_pinned() -> None:
    """A log the guest appends to and never reads: pinned at first (writes count until shown unread), then not."""
    n = 4000
    c = cycle(n)
    pinned: list[Region] = []
    history = []
    for t in range(1, 40):
        log = range(50 * t, 50 * t + 50)  # 50 blocks appended a cycle
        pinned = c.step(BlockValues.empty(), listed(log, 1.0), pinned, size_bytes=n * BS, budget=64 * BS,
                        now=float(t), reads=GuestReads.empty()).regions
        history.append(bool(pinned))
    assert any(history[:5]) and not any(history[-10:])
    assert c.read_back.share < 0.05


def test_a_paused_guest_leaves_the_plan_where_it_is() -> None:
    """Nothing read or written: every block cools alike, so the pinned window neither moves nor grows."""
    c = cycle()
    rng = np.random.default_rng(3)
    pinned: list[Region] = []
    for t in range(1, 20):  # a hot zone of 30 blocks, read unevenly, larger than the 8-block budget
        counts = rng.integers(1, PAGES, size=30).astype(np.float32)
        pinned = step(c, GuestReads(BlockValues(np.arange(40, 70, dtype=np.int64), counts), BlockValues.empty()),
                      float(t), pinned)
    spans = {tuple(r.span for r in pinned)}
    for t in range(20, 40):
        pinned = step(c, GuestReads.empty(), float(t), pinned)
        if pinned:
            spans.add(tuple(r.span for r in pinned))
    assert len(spans) == 1


def test_pin_share_follows_the_side_whose_ghosts_miss() -> None:
    share = PinShare(step=0.1, memory=2)
    blocks = np.arange(10, dtype=np.int64)
    held = BlockValues(blocks[5:], np.ones(5, np.float32))
    share.remember(left_out=blocks[:5], kernel_held=held)
    pages = np.full(10, 16, np.float32)
    assert share.update(blocks[5:], pages[5:]) == 0.9  # misses on what the kernel's cache held: pin less
    share.remember(left_out=blocks[:5], kernel_held=held)
    assert share.update(blocks[:5], pages[:5]) == 1.0  # misses on what the plan wanted: pin more
    assert share.update(np.zeros(0, np.int64), np.zeros(0, np.float32)) == 1.0  # no misses: as it was


def test_a_block_the_kernel_held_a_page_of_counts_by_that_page_not_the_whole_block() -> None:
    """Scattered reads beside a hot set: each makes a cold 1 MiB block resident by one page; a later miss
    in it was most likely never cached. Weighed by what was cached, they do not outvote the pins' ghosts."""
    share = PinShare(step=0.1, memory=2)
    cold = np.arange(100, 200, dtype=np.int64)
    share.remember(left_out=np.array([5], np.int64), kernel_held=BlockValues(cold, np.full(100, 1 / 256, np.float32)))
    missed = np.concatenate([np.array([5], np.int64), cold])
    assert share.update(missed, np.ones(101, np.float32)) > 0.99   # 1 pin-ghost page against 100 / 256 pages
    share.remember(left_out=np.zeros(0, np.int64), kernel_held=BlockValues(cold[:1], np.ones(1, np.float32)))
    share.remember(left_out=np.zeros(0, np.int64), kernel_held=BlockValues(cold[:1], np.full(1, 0.5, np.float32)))
    before = share.value
    assert share.update(cold[:1], np.ones(1, np.float32)) < before   # held whole in one of the cycles: counts whole


def test_pins_the_kernel_would_keep_anyway_give_way() -> None:
    """Misses fall on blocks the kernel's cache held a moment ago: the cycle pins less of its budget."""
    c = cycle()
    pinned: list[Region] = []
    hot = BlockValues(np.arange(20, 28, dtype=np.int64), np.full(8, PAGES, np.float32))
    for t in range(1, 40):
        churn = np.arange(60 + (t % 3) * 10, 70 + (t % 3) * 10, dtype=np.int64)  # evicted and read again
        reads = GuestReads(hot, BlockValues(churn, np.full(churn.size, PAGES, np.float32)))
        pinned = step(c, reads, float(t), pinned, resident=BlockValues(np.arange(60, 90, dtype=np.int64),
                                                                       np.ones(30, np.float32)))
    assert c.pin_share.value < 0.5
    assert sum(r.length for r in pinned) < 8 * BS
