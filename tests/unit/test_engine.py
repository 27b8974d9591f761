"""DiskEngine on real files: residency in the real page cache, real mlock.

The "guest" here reads the image with pread after dropping it from the
cache, which is what QEMU does for a writethrough disk.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from vmcache.model.blocks import BlockValues
from vmcache.model.extents import DirtyRead
from vmcache.model.reads import GuestReads
from vmcache.service.engine import DiskEngine
from vmcache.service.enginepolicy import EnginePolicy
from vmcache.host.pagecache import scan_residency
from vmcache.model.params import ModelParams
from vmcache.model.region import Region
from vmcache.model.warm import WarmStart

from tests.pagecache_util import drop, fake_meminfo, locked_pages

MiB = 1 << 20
GiB = 1 << 30
SIZE = 256 * MiB
# Fast model for tests: one interval per cycle, quick decay.
PARAMS = ModelParams(block_size=MiB, interval=1.0, decay=0.5, pinned_decay=0.95, threshold=0.2)


def meminfo(available: int = 64 * GiB):
    return fake_meminfo(available)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 0.5  # each cycle reads the clock twice: one interval per cycle
        return self.now


@pytest.fixture
def image(tmp_path: Path) -> Path:
    path = tmp_path / "disk.raw"
    with open(path, "wb") as f:
        f.truncate(SIZE)
    drop(path)
    return path


def guest_read(path: Path, offset: int, length: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        for off in range(offset, offset + length, 64 * 1024):
            os.pread(fd, 64 * 1024, off)
    finally:
        os.close(fd)


def guest_write(path: Path, offset: int, length: int) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        for off in range(offset, offset + length, 64 * 1024):
            os.pwrite(fd, b"\xa5" * (64 * 1024), off)
    finally:
        os.close(fd)


def guest_spread(path: Path, offset: int, length: int, part: int, parts: int = 16) -> None:
    """Read page ``part`` of every ``parts`` pages of the range: a guest spreading through it, a page at a time
    (4 KiB reads this far apart start no readahead)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        for off in range(offset + part * 4096, offset + length, parts * 4096):
            os.pread(fd, 4096, off)
    finally:
        os.close(fd)


def engine(path: Path, budget: int = 64 * MiB, **kw) -> DiskEngine:
    """An engine under a 1 GiB floor; ``kw`` may hold EnginePolicy's fields besides DiskEngine's arguments."""
    kw.setdefault("meminfo", meminfo())
    policy = EnginePolicy(floor_bytes=GiB, **{k: kw.pop(k) for k in list(kw) if k in EnginePolicy.__dataclass_fields__})
    return DiskEngine(path, params=kw.pop("params", PARAMS), budget=budget, policy=policy, clock=Clock(), **kw)


def pinned(e: DiskEngine) -> list[Region]:
    return e._pinner.pinned


def pinned_spans(e: DiskEngine) -> list[tuple[int, int]]:
    return sorted(r.span for r in pinned(e))


def test_a_region_the_guest_keeps_reading_gets_pinned_and_stays_resident(image: Path) -> None:
    with engine(image) as e:
        for _ in range(4):
            guest_read(image, 100 * MiB, 16 * MiB)
            stats = e.cycle()
        assert stats.pinned_bytes >= 16 * MiB
        assert any(r.start <= 100 * MiB and r.end >= 116 * MiB for r in pinned(e))
        # Pinned pages survive an attempt to drop them; others don't.
        guest_read(image, 10 * MiB, 4 * MiB)
        drop(image)
        res = scan_residency(image, MiB)
        assert res.fraction[100:116].min() == 1.0
        assert res.fraction[10:14].max() == 0.0
    # Closing released everything: now the region can be dropped.
    drop(image)
    assert scan_residency(image, MiB).resident_pages == 0


def test_pinning_does_not_feed_back_no_creep_over_the_disk(image: Path) -> None:
    with engine(image, budget=200 * MiB) as e:
        for _ in range(3):
            guest_read(image, 120 * MiB, 8 * MiB)
            e.cycle()
        settled = e.cycle().pinned_bytes
        assert settled >= 8 * MiB
        for _ in range(30):
            stats = e.cycle()
            assert stats.pinned_bytes <= settled
            assert stats.guest_read_miss_bytes == 0
        # Residency did not grow past what was read and pinned (no readahead creep).
        assert stats.resident_bytes <= settled + 8 * MiB


def test_an_idle_pinned_region_is_released(image: Path) -> None:
    params = ModelParams(block_size=MiB, interval=1.0, decay=0.5, pinned_decay=0.5, threshold=0.2, keep_factor=1.0)
    with engine(image, params=params) as e:
        guest_read(image, 50 * MiB, 8 * MiB)
        assert e.cycle().pinned_bytes > 0
        for _ in range(20):
            stats = e.cycle()
        assert stats.pinned_bytes == 0


def test_written_region_outranks_read_only_region(image: Path) -> None:
    writes: Iterator[list[tuple[int, int]]] = iter([])

    def source() -> DirtyRead:
        rows: list[tuple[int, int]] = next(writes, [])
        return DirtyRead(extents=np.array(rows, dtype=np.int64).reshape(-1, 2))

    writes = iter([[(200 * MiB, 8 * MiB)]] * 10)
    with engine(image, budget=12 * MiB, writes=source) as e:
        for _ in range(4):
            guest_read(image, 20 * MiB, 8 * MiB)
            guest_write(image, 200 * MiB, 8 * MiB)  # through the page cache, as a writethrough disk's writes go
            stats = e.cycle()
        assert stats.guest_written_bytes == 8 * MiB
        spans = pinned_spans(e)
        assert spans and spans[-1][0] >= 190 * MiB, spans
        assert stats.pinned_bytes <= 12 * MiB


def test_budget_is_never_exceeded_and_can_change_between_cycles(image: Path) -> None:
    with engine(image, budget=20 * MiB) as e:
        for cycle in range(8):
            guest_read(image, (cycle * 30) * MiB, 10 * MiB)
            stats = e.cycle()
            assert stats.pinned_bytes <= 20 * MiB
        e.budget = 4 * MiB
        assert e.cycle().pinned_bytes <= 4 * MiB


def test_floor_keeps_the_engine_from_pinning_and_says_it_is_backing_off(image: Path) -> None:
    with engine(image, meminfo=meminfo(available=512 * MiB)) as e:
        for _ in range(4):
            guest_read(image, 100 * MiB, 16 * MiB)
            stats = e.cycle()
        assert stats.pinned_bytes == 0
        assert stats.backing_off


def test_image_growing_and_shrinking_between_cycles(image: Path) -> None:
    with engine(image) as e:
        for _ in range(3):
            guest_read(image, 200 * MiB, 16 * MiB)
            e.cycle()
        assert e.last is not None and e.last.pinned_bytes > 0
        os.truncate(image, 100 * MiB)  # the pinned region is now past the end
        stats = e.cycle()
        assert stats.size_bytes == 100 * MiB
        assert all(r.end <= 100 * MiB for r in pinned(e))
        os.truncate(image, 400 * MiB)
        guest_read(image, 300 * MiB, 8 * MiB)
        stats = e.cycle()
        assert stats.size_bytes == 400 * MiB
        assert len(e.heat) == 400


def _written(rows: list[tuple[int, int]]):
    return lambda: DirtyRead(extents=np.array(rows, dtype=np.int64).reshape(-1, 2))


def test_prefetch_rate_limits_device_reads_for_new_cold_regions(image: Path) -> None:
    # The guest spreads through 64-96 MiB, a page in 8 of each block a cycle: pinning the blocks reads the
    # rest from the device. At 8 MiB/s with 1 s cycles the pins load at most 8 MiB of uncached pages a cycle;
    # unlimited, the range is pinned in the cycle it is planned.
    def run(rate: int | None) -> tuple[list[int], list[int]]:
        pinned, loaded = [], []
        with engine(image, budget=64 * MiB, prefetch_rate=rate) as e:
            for part in range(7):
                guest_spread(image, 64 * MiB, 32 * MiB, part * 3 % 8, parts=8)
                before = scan_residency(image, MiB).resident_pages
                pinned.append(e.cycle().pinned_bytes)
                loaded.append((scan_residency(image, MiB).resident_pages - before) * 4096)
        drop(image)
        return pinned, loaded
    limited, loaded = run(8 * MiB)
    assert limited[:2] == [0, 0] and 0 < limited[2] < 16 * MiB, limited  # a read and one return are no spreading
    assert max(loaded) <= 8 * MiB, loaded  # paid for by what each block has uncached, not by its heat
    unlimited, loaded = run(None)
    assert unlimited[2] == 32 * MiB and loaded[2] == 20 * MiB, (unlimited, loaded)


@pytest.mark.parametrize("rate", [None, 1 << 20])
def test_fill_cached_pins_what_the_guest_spreads_through_and_reads_nothing(image: Path, rate: int | None) -> None:
    # As above, but the pins take only the pages cached: each cycle locks what the guest read. A pin that
    # reads nothing need not wait for the guest to spread through, nor for the prefetch rate, which pays
    # for device reads: the blocks are pinned once hot, at 1 MiB/s as unlimited.
    base = locked_pages()
    with engine(image, budget=64 * MiB, prefetch_rate=rate, fill=False) as e:
        pinned, loaded = [], []
        for part in range(4):
            guest_spread(image, 64 * MiB, 32 * MiB, part * 3 % 8, parts=8)
            before = scan_residency(image, MiB).resident_pages
            pinned.append(e.cycle().pinned_bytes)
            loaded.append(scan_residency(image, MiB).resident_pages - before)
        assert pinned == [0, 32 * MiB, 32 * MiB, 32 * MiB] and loaded == [0] * 4, (pinned, loaded)
        cached = scan_residency(image, MiB).resident_pages * 4096
        assert locked_pages() - base == cached == 4 * 4 * MiB  # four of every eight pages, all locked
        drop(image)
        assert scan_residency(image, MiB).resident_pages * 4096 == cached
    assert locked_pages() == base


def test_fill_cached_pins_written_blocks_that_are_not_cached_whole(image: Path) -> None:
    # A block the guest writes but never reads, with a few pages never written (a new qcow2 overlay's first
    # block: metadata with holes, then the guest's data). Filling it would read those pages, so the load gate
    # keeps it out of a new pin; locking only what is cached reads nothing and the block is pinned.
    def writes() -> DirtyRead:
        return DirtyRead(extents=np.array([[60 * MiB + 15 * 4096, 4 * MiB - 15 * 4096]], dtype=np.int64))

    for fill, first in ((True, 61 * MiB), (False, 60 * MiB)):
        drop(image)
        with engine(image, budget=64 * MiB, prefetch_rate=None, fill=fill, writes=writes) as e:
            guest_write(image, 60 * MiB + 64 * 1024, 4 * MiB - 64 * 1024)
            for _ in range(3):
                e.cycle()
            assert [r.span for r in pinned(e)] == [(first, 64 * MiB - first)], (fill, pinned_spans(e))


def test_fill_cached_still_loads_a_saved_hot_set(image: Path) -> None:
    with engine(image, budget=64 * MiB, prefetch_rate=None, fill=False) as e:
        e.warm = WarmStart([(Region(10 * MiB, 4 * MiB, 0.0), 1.0)], PARAMS)
        stats = e.cycle()  # the guest reads nothing: what is pinned comes from the saved set
        assert stats.pinned_bytes == 4 * MiB and stats.warm_restored_bytes == 4 * MiB
        assert scan_residency(image, MiB).fraction[10:14].tolist() == [1.0] * 4


def test_prefetch_rate_costs_nothing_for_regions_already_cached(image: Path) -> None:
    with engine(image, budget=64 * MiB, prefetch_rate=1 << 20) as e:
        for _ in range(3):
            guest_read(image, 100 * MiB, 16 * MiB)
            stats = e.cycle()
        assert stats.pinned_bytes >= 16 * MiB


def test_pinned_region_the_guest_keeps_reading_stays_pinned_by_read_evidence(image: Path) -> None:
    # No hold at all (pinned_decay == decay): only the referenced bits of the
    # pinned pages can tell that the guest still reads the region.
    params = ModelParams(block_size=MiB, interval=1.0, decay=0.5, pinned_decay=0.5, threshold=0.2, keep_factor=1.0)
    with engine(image, params=params, prefetch_rate=None) as e:
        for _ in range(30):
            guest_read(image, 100 * MiB, 16 * MiB)
            stats = e.cycle()
        assert stats.pinned_bytes >= 16 * MiB
        assert any(r.start <= 100 * MiB and r.end >= 116 * MiB for r in pinned(e))


def test_pinned_region_the_guest_stops_reading_is_released_by_read_evidence(image: Path) -> None:
    # A long hold (pinned_decay 0.99) would keep it for hundreds of cycles; the
    # evidence that nobody reads it any more releases it at the normal decay.
    params = ModelParams(block_size=MiB, interval=1.0, decay=0.5, pinned_decay=0.99, threshold=0.2)
    with engine(image, params=params, prefetch_rate=None) as e:
        for _ in range(5):
            guest_read(image, 100 * MiB, 16 * MiB)
            e.cycle()
        assert e.last is not None and e.last.pinned_bytes >= 16 * MiB
        released = next((i for i in range(20) if e.cycle().pinned_bytes == 0), None)
        assert released is not None and released < 10


def test_without_read_evidence_an_idle_pinned_region_is_held(image: Path) -> None:
    from vmcache.host.pagerefs import PageRefs

    params = ModelParams(block_size=MiB, interval=1.0, decay=0.5, pinned_decay=0.99, threshold=0.2)
    blind = PageRefs(kpageflags="/nonexistent")  # e.g. not root: no PFNs, no evidence
    with engine(image, params=params, prefetch_rate=None, refs=blind) as e:
        for _ in range(5):
            guest_read(image, 100 * MiB, 16 * MiB)
            e.cycle()
        for _ in range(20):
            stats = e.cycle()
        assert stats.pinned_bytes >= 16 * MiB


def test_demand_is_the_plan_at_the_full_budget_whatever_the_grant(image: Path) -> None:
    with engine(image, budget=4 * MiB) as e:  # granted 4 MiB of a disk whose hot set is 16 MiB
        assert e.demand(64 * MiB) == ()  # nothing known before the first cycle
        for _ in range(4):
            guest_read(image, 100 * MiB, 16 * MiB)
            stats = e.cycle()
        assert stats.pinned_bytes <= 4 * MiB
        curve = e.demand(64 * MiB)
        assert 16 * MiB <= curve[-1][0] <= 64 * MiB  # it asks for the hot set, not for the grant
        densities = [(v1 - v0) / (b1 - b0) for (b0, v0), (b1, v1) in zip(((0, 0.0),) + curve, curve)]
        assert densities == sorted(densities, reverse=True) and 0 < densities[0] <= 1.0
        assert e.demand(8 * MiB)[-1][0] <= 8 * MiB


def test_a_smaller_grant_releases_the_lowest_priority_region_first(image: Path) -> None:
    with engine(image, budget=64 * MiB) as e:
        for cycle in range(6):
            guest_read(image, 10 * MiB, 8 * MiB)  # read every cycle: the hotter region
            if cycle >= 3:
                guest_read(image, 100 * MiB, 8 * MiB)  # read from the fourth cycle on
            e.cycle()
        spans = pinned_spans(e)
        assert any(s <= 10 * MiB < s + n for s, n in spans) and any(s <= 100 * MiB < s + n for s, n in spans)
        e.budget = 10 * MiB  # the grant shrinks to one region's worth
        guest_read(image, 10 * MiB, 8 * MiB)
        guest_read(image, 100 * MiB, 8 * MiB)
        e.cycle()
        spans = pinned_spans(e)
        # the hotter region stays whole; the newer, cooler one keeps only what is left of the grant
        assert (10 * MiB, 8 * MiB) in spans
        assert sum(n for s, n in spans if s >= 100 * MiB) <= 2 * MiB


def test_heat_map_of_a_disk_larger_than_a_picture_is_shown_in_coarser_blocks(
        image: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to PICTURE_BLOCKS the picture has the model's blocks; beyond, bins of them (no per-block arrays)."""
    from vmcache.service import engine as engine_module

    with engine(image) as e:
        for _ in range(4):
            guest_read(image, 100 * MiB, 16 * MiB)
            e.cycle()
        fine = e.heatmap_data("vda")
        assert fine.block_size == MiB and fine.nblocks == SIZE // MiB
        np.testing.assert_array_equal(fine.heat, e.heat)
        np.testing.assert_array_equal(fine.pinned, e.pinned_mask())
        assert fine.pinned[100:116].all() and not fine.resident[100:116].any()  # pinned: ours, not the guest's
        monkeypatch.setattr(engine_module, "PICTURE_BLOCKS", 16)
        coarse = e.heatmap_data("vda")
    assert coarse.block_size == 16 * MiB and coarse.nblocks == 16 and coarse.image_size == SIZE
    np.testing.assert_array_equal(coarse.heat, fine.heat.reshape(16, 16).max(axis=1))
    np.testing.assert_array_equal(coarse.pinned, fine.pinned.reshape(16, 16).any(axis=1))
    np.testing.assert_allclose(coarse.resident, fine.resident.reshape(16, 16).mean(axis=1), rtol=1e-6)


@pytest.mark.parametrize("decide", [False, True])
def test_counted_reads_decide_only_when_asked_and_are_reported_either_way(image: Path, decide: bool) -> None:
    """Counted reads of 40-44 MiB (the page cache never sees them: only the counter says so) heat that range
    with ``decide_on_reads``; without it the model infers from residency, finds nothing, heats nothing. (Not
    pinned either way: the load gate fills only blocks the page cache shows the guest reading.)"""
    index = np.arange(40, 44, dtype=np.int64)
    counted = GuestReads(BlockValues(index, np.full(4, 256, np.float32)), BlockValues.empty())
    with engine(image, reads=lambda nblocks: counted, decide_on_reads=decide) as e:
        for _ in range(4):
            e.cycle()
        assert e.last_reads is counted
        heat = e.heat
        assert pinned_spans(e) == []
    if decide:
        assert heat[40:44].min() > PARAMS.threshold, heat[38:46]
    else:
        assert heat.max() == 0.0, heat.max()
