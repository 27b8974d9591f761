"""Pinner on real files with real mlock: residency, VmLck, budget, floor, truncation."""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest

from vmcache.errors import PinError
from vmcache.host import locking
from vmcache.host.meminfo import MemInfo
from vmcache.host.pagecache import PAGE_SIZE, scan_residency
from vmcache.host.pinner import Pinner
from vmcache.model.blocks import blocks_mask
from vmcache.model.region import Region

from tests.pagecache_util import drop, fake_meminfo, locked_pages, random_image, vmlck

MiB = 1 << 20
GiB = 1 << 30
BLOCK = 1 * MiB
SIZE = 32 * MiB


def plenty() -> MemInfo:
    return fake_meminfo(available=64 * GiB)()


@pytest.fixture
def image(tmp_path: Path) -> Path:
    """A 32 MiB image on disk (synced), nothing of it cached."""
    return random_image(tmp_path / "disk.img", SIZE)


def blocks(path: Path) -> np.ndarray:
    return scan_residency(path, BLOCK).fraction


def test_pinned_ranges_are_resident_locked_and_survive_dontneed(image: Path) -> None:
    base = vmlck()
    with Pinner(image, floor_bytes=0, meminfo=plenty) as pinner:
        report = pinner.apply([Region(4 * MiB, 3 * MiB, 2.0), Region(20 * MiB, 1 * MiB, 1.0)], budget=SIZE)
        assert report.pinned_bytes == report.locked_bytes == 4 * MiB  # filled whole: all of it held
        assert vmlck() - base == 4 * MiB
        pinned = np.zeros(32, dtype=bool)
        pinned[4:7] = pinned[20] = True
        frac = blocks(image)
        np.testing.assert_array_equal(frac[pinned], 1.0)
        np.testing.assert_array_equal(frac[~pinned], 0.0)  # pinning loads the regions only, no read-around
        # read everything into the cache, then ask the kernel to drop it all
        with open(image, "rb") as f:
            while f.read(4 * MiB):
                pass
        assert blocks(image).min() == 1.0
        drop(image)
        frac = blocks(image)
        np.testing.assert_array_equal(frac[pinned], 1.0)
        np.testing.assert_array_equal(frac[~pinned], 0.0)
        np.testing.assert_array_equal(blocks_mask(pinner.pinned, BLOCK, 32), pinned)
        # unpinning lowers VmLck and lets the kernel drop the pages
        report = pinner.apply([Region(20 * MiB, 1 * MiB, 1.0)], budget=SIZE)
        assert vmlck() - base == 1 * MiB
        assert [r.span for r in report.removed] == [(4 * MiB, 3 * MiB)]
        drop(image)
        frac = blocks(image)
        assert frac[4:7].tolist() == [0.0, 0.0, 0.0] and frac[20] == 1.0
    assert vmlck() == base


def test_a_new_region_is_loaded_with_large_reads(image: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not one 4 KiB device read per page (mlock's faults): a busy device pays per operation."""
    asked: list[tuple[int, int]] = []
    real = os.posix_fadvise

    def counting(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_WILLNEED:
            asked.append((offset, length))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", counting)
    with Pinner(image, floor_bytes=0, meminfo=plenty) as pinner:
        pinner.apply([Region(4 * MiB, 3 * MiB + 8192, 1.0)], budget=SIZE)
        piece = 128 << 10
        assert asked == [(offset, piece) for offset in range(4 * MiB, 7 * MiB, piece)] + [(7 * MiB, 8192)]
        frac = blocks(image)
        assert frac[4:7].tolist() == [1.0, 1.0, 1.0] and frac[8] == 0.0


def test_loading_reads_nothing_beside_the_region_where_a_sequential_reader_left_readahead_marks(image: Path) -> None:
    """A guest's sequential read leaves readahead marks in the page cache; the load must not set them off.

    A read(2) through a marked page starts the next readahead window past
    it, whatever POSIX_FADV_RANDOM says: pages beside the pin, read from the
    device for nobody, which the next scan takes for guest reads.
    """
    with open(image, "rb") as f:  # another reader, sequential: the kernel reads ahead and marks its windows
        for _ in range(12):
            f.read(MiB)
    before = blocks(image)
    for _ in range(50):  # its last readahead may still be in flight
        time.sleep(0.1)
        before, settled = blocks(image), before
        if np.array_equal(before, settled):
            break
    region = np.zeros(32, dtype=bool)
    region[4:16] = True
    with Pinner(image, floor_bytes=0, meminfo=plenty) as pinner:
        pinner.apply([Region(4 * MiB, 12 * MiB, 1.0)], budget=SIZE)
        after = blocks(image)
        np.testing.assert_array_equal(after[region], 1.0)
        np.testing.assert_array_equal(after[~region], before[~region])


def test_apply_changes_only_the_difference(image: Path, caplog: pytest.LogCaptureFixture) -> None:
    a, b, c = Region(0, 2 * MiB, 3.0), Region(8 * MiB, 2 * MiB, 2.0), Region(16 * MiB, 2 * MiB, 1.0)
    with Pinner(image, floor_bytes=0, meminfo=plenty) as pinner:
        first = pinner.apply([a, b], budget=SIZE)
        assert set(first.added) == {a, b} and first.removed == ()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="vmcache.host.pinner"):
            second = pinner.apply([c, a], budget=SIZE)
        assert second.added == (c,)
        assert [r.span for r in second.removed] == [b.span]
        assert second.kept == 1
        messages = [r.getMessage() for r in caplog.records]
        assert [m for m in messages if m.startswith(("pin.add", "pin.remove"))] == [
            f"pin.remove start={b.start} length={b.length} reason=plan",
            f"pin.add start={c.start} length={c.length} priority=1",
        ]
        # same spans, new priorities: nothing mapped or unmapped
        third = pinner.apply([Region(0, 2 * MiB, 0.5), Region(16 * MiB, 2 * MiB, 9.0)], budget=SIZE)
        assert third.added == () and third.removed == () and third.kept == 2
        assert [r.priority for r in pinner.pinned] == [9.0, 0.5]
        # a region that changed extent is re-pinned
        fourth = pinner.apply([Region(0, 3 * MiB, 0.5), Region(16 * MiB, 2 * MiB, 9.0)], budget=SIZE)
        assert [r.span for r in fourth.added] == [(0, 3 * MiB)]
        assert [r.span for r in fourth.removed] == [(0, 2 * MiB)]
        assert pinner.pinned_bytes == 5 * MiB


def test_budget_is_never_exceeded(image: Path) -> None:
    base = vmlck()
    regions = [Region(i * 4 * MiB, 3 * MiB, float(10 - i)) for i in range(8)]  # 24 MiB wanted
    with Pinner(image, floor_bytes=0, meminfo=plenty) as pinner:
        report = pinner.apply(regions, budget=10 * MiB)
        assert report.pinned_bytes == 9 * MiB <= 10 * MiB
        assert vmlck() - base == 9 * MiB
        assert [r.priority for r in report.regions] == [10.0, 9.0, 8.0]  # the highest priorities
        assert report.skipped_for_budget == 15 * MiB
        # a smaller budget drops the lowest-priority pins
        report = pinner.apply(regions, budget=4 * MiB)
        assert [r.priority for r in report.regions] == [10.0]
        assert vmlck() - base == 3 * MiB


def test_floor_limits_new_pins(image: Path) -> None:
    regions = [Region(i * 4 * MiB, 2 * MiB, float(10 - i)) for i in range(4)]
    floor = 1 * GiB
    with Pinner(image, floor_bytes=floor, meminfo=fake_meminfo(floor + 5 * MiB)) as pinner:
        report = pinner.apply(regions, budget=SIZE)
        # 5 MiB of headroom: the two highest-priority 2 MiB regions fit, not a third
        assert [r.priority for r in report.regions] == [10.0, 9.0]
        assert report.skipped_for_floor == 4 * MiB


def test_under_the_floor_nothing_new_and_lowest_priority_released_first(image: Path) -> None:
    a, b, c = Region(0, 2 * MiB, 3.0), Region(8 * MiB, 2 * MiB, 2.0), Region(16 * MiB, 2 * MiB, 1.0)
    new = Region(24 * MiB, 2 * MiB, 5.0)
    floor = 1 * GiB
    memory = {"available": 8 * GiB}
    base = vmlck()
    with Pinner(image, floor_bytes=floor, meminfo=lambda: fake_meminfo(memory["available"])()) as pinner:
        pinner.apply([a, b, c], budget=SIZE)
        assert vmlck() - base == 6 * MiB
        memory["available"] = floor - 3 * MiB  # releasing two 2 MiB pins gets back above
        report = pinner.apply([new, a, b, c], budget=SIZE)
        assert report.added == ()
        assert report.skipped_for_floor == new.length
        assert [r.span for r in report.removed] == [c.span, b.span]
        assert report.released_for_pressure == 4 * MiB
        assert [r.span for r in pinner.pinned] == [a.span]
        assert vmlck() - base == 2 * MiB
        assert report.under_floor
    assert vmlck() == base


def test_under_the_floor_is_reported_even_when_the_plan_adds_nothing(image: Path) -> None:
    """The agent's state says backing-off for as long as the host is under the floor, not only in a cycle
    whose plan had something to add or release (the status otherwise reads 'running' under the floor)."""
    floor = 1 * GiB
    memory = {"available": 8 * GiB}
    with Pinner(image, floor_bytes=floor, meminfo=lambda: fake_meminfo(memory["available"])()) as pinner:
        assert not pinner.apply([], budget=SIZE).under_floor
        memory["available"] = floor - 3 * MiB
        report = pinner.apply([], budget=SIZE)
        assert report.under_floor and not (report.skipped_for_floor or report.released_for_pressure)


def test_a_limited_cgroup_s_room_limits_new_pins_and_releases_them_when_it_runs_out(
        image: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The room a memory cgroup limit leaves is held to as the floor is, wherever it is the tighter of the two."""
    a, b, c = Region(0, 2 * MiB, 3.0), Region(8 * MiB, 2 * MiB, 2.0), Region(16 * MiB, 2 * MiB, 1.0)
    room: dict[str, int | None] = {"bytes": 5 * MiB}
    base = vmlck()
    caplog.set_level("INFO")
    with Pinner(image, floor_bytes=1 * GiB, meminfo=plenty, room=lambda: room["bytes"]) as pinner:
        report = pinner.apply([a, b, c], budget=SIZE)
        assert [r.span for r in pinner.pinned] == [a.span, b.span]  # 5 MiB of room: two 2 MiB pins
        assert report.skipped_for_floor == c.length
        assert "reason=cgroup" in caplog.text
        room["bytes"] = -3 * MiB  # QEMU's memory grew into the margin: two pins go, lowest priority first
        report = pinner.apply([a, b, c], budget=SIZE)
        assert [r.span for r in report.removed] == [b.span, a.span]
        assert report.released_for_pressure == 4 * MiB and pinner.pinned == []
        assert "pin.remove start=8388608 length=2097152 reason=cgroup" in caplog.text
        room["bytes"] = None  # the limit is gone: MemAvailable above the floor is all that counts
        pinner.apply([a, b, c], budget=SIZE)
        assert len(pinner.pinned) == 3 and vmlck() - base == 6 * MiB
    assert vmlck() == base


def test_a_zone_larger_than_a_cgroup_s_room_is_pinned_as_far_as_it_goes_and_shrinks_under_pressure(
        image: Path, caplog: pytest.LogCaptureFixture) -> None:
    """One hot zone is one region: a tight room pins its head, and a shortfall gives back its tail, not all of it.

    Each cut leaves 4 MiB (``TRIM_MIN``) of the room free.
    """
    zone = Region(0, 24 * MiB, 2.0)
    room: dict[str, int | None] = {"bytes": 14 * MiB}
    base = vmlck()
    caplog.set_level("INFO")
    with Pinner(image, floor_bytes=1 * GiB, meminfo=plenty, room=lambda: room["bytes"]) as pinner:
        report = pinner.apply([zone], budget=SIZE)
        assert [r.span for r in pinner.pinned] == [(0, 10 * MiB)] and report.skipped_for_floor == 14 * MiB
        assert vmlck() - base == 10 * MiB
        room["bytes"] = 10 * MiB  # the room grew (the 10 MiB locked are charged already): the head grows by 6
        pinner.apply([zone], budget=SIZE)
        assert [r.span for r in pinner.pinned] == [(0, 16 * MiB)] and vmlck() - base == 16 * MiB
        room["bytes"] = 2 * MiB  # wavering within the 4 MiB left: nothing moves
        report = pinner.apply([zone], budget=SIZE)
        assert report.added == () and report.removed == ()
        room["bytes"] = -3 * MiB - 100  # into the margin: the tail goes with 4 MiB more, the head stays locked
        report = pinner.apply([zone], budget=SIZE)
        assert report.released_for_pressure == 7 * MiB + 4096 and not report.failures
        assert [r.span for r in pinner.pinned] == [(0, 9 * MiB - 4096)]
        assert vmlck() - base == 9 * MiB - 4096
        np.testing.assert_array_equal(blocks(image)[:8], 1.0)
        assert "pin.remove start=0 length=16777216 reason=cgroup" in caplog.text
    assert vmlck() == base


def test_a_grown_region_needs_headroom_only_for_its_new_bytes(image: Path) -> None:
    floor = 1 * GiB
    memory = {"available": 8 * GiB}
    base = vmlck()
    with Pinner(image, floor_bytes=floor, meminfo=lambda: fake_meminfo(memory["available"])()) as pinner:
        pinner.apply([Region(4 * MiB, 2 * MiB, 1.0)], budget=SIZE)
        memory["available"] = floor + 1 * MiB + 512 * 1024  # 1.5 MiB of headroom: the whole 3 MiB would not fit
        grown = Region(3 * MiB, 3 * MiB, 2.0)
        report = pinner.apply([grown], budget=SIZE)
        assert report.added == (grown,) and report.skipped_for_floor == 0
        assert [r.span for r in report.removed] == [(4 * MiB, 2 * MiB)]
        assert [r.span for r in pinner.pinned] == [grown.span]
        assert vmlck() - base == 3 * MiB
        np.testing.assert_array_equal(blocks(image)[3:6], 1.0)
    assert vmlck() == base


def test_a_moved_region_is_locked_before_the_old_one_goes(image: Path, caplog: pytest.LogCaptureFixture) -> None:
    base = vmlck()
    with Pinner(image, floor_bytes=0, meminfo=plenty) as pinner:
        pinner.apply([Region(0, 4 * MiB, 1.0)], budget=4 * MiB)
        moved = Region(2 * MiB, 4 * MiB, 1.0)
        with caplog.at_level(logging.INFO, logger="vmcache.host.pinner"):
            report = pinner.apply([moved], budget=4 * MiB)
        assert report.added == (moved,)
        assert [r.span for r in pinner.pinned] == [moved.span]
        assert vmlck() - base == 4 * MiB
        messages = [r.getMessage() for r in caplog.records]
        add = next(i for i, m in enumerate(messages) if m.startswith("pin.add"))
        remove = next(i for i, m in enumerate(messages) if m.startswith("pin.remove"))
        assert add < remove and "reason=reshape" in messages[remove], messages
        frac = blocks(image)
        np.testing.assert_array_equal(frac[2:6], 1.0)
    assert vmlck() == base


def test_a_region_the_plan_trims_is_cut_where_it_lies_not_locked_anew(image: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    base = vmlck()
    with Pinner(image, floor_bytes=0, meminfo=plenty) as pinner:
        pinner.apply([Region(4 * MiB, 12 * MiB, 1.0)], budget=SIZE)
        trimmed = Region(6 * MiB, 8 * MiB, 2.0)
        with caplog.at_level(logging.INFO, logger="vmcache.host.pinner"):
            report = pinner.apply([trimmed], budget=SIZE)
        messages = [r.getMessage() for r in caplog.records]
        assert any(m.startswith("pin.trim") for m in messages), messages
        assert not any(m.startswith(("pin.add", "pin.remove")) for m in messages), messages  # nothing locked anew
        assert report.regions == (trimmed,) and report.pinned_bytes == report.locked_bytes == 8 * MiB
        assert vmlck() - base == 8 * MiB
        drop(image)
        frac = blocks(image)
        np.testing.assert_array_equal(frac[6:14], 1.0)  # still locked
        assert frac[4:6].tolist() == frac[14:16].tolist() == [0.0, 0.0]  # the cut pages are the kernel's again
        # a region that grows past its pin is locked whole again, as before
        grown = Region(6 * MiB, 10 * MiB, 2.0)
        assert pinner.apply([grown], budget=SIZE).added == (grown,)
        assert vmlck() - base == 10 * MiB
        pinner.apply([Region(8 * MiB, 2 * MiB, 2.0)], budget=SIZE)   # cut at both ends
        assert vmlck() - base == 2 * MiB and [r.span for r in pinner.pinned] == [(8 * MiB, 2 * MiB)]
    assert vmlck() == base


def test_under_the_floor_a_reshaped_region_keeps_its_old_pin_and_priority_order_holds(image: Path) -> None:
    """The plan reshapes the top region while MemAvailable is under the floor:
    nothing new is pinned, the old pin of that region stays (at its new
    priority), and pressure releases the low-priority region first."""
    big, small = Region(0, 8 * MiB, 10.0), Region(20 * MiB, 2 * MiB, 1.0)
    floor = 1 * GiB
    memory = {"available": 8 * GiB}
    base = vmlck()
    with Pinner(image, floor_bytes=floor, meminfo=lambda: fake_meminfo(memory["available"])()) as pinner:
        pinner.apply([big, small], budget=SIZE)
        memory["available"] = floor - 1 * MiB  # releasing the small pin is enough
        bigger = Region(0, 10 * MiB, 12.0)
        report = pinner.apply([bigger, small], budget=SIZE)
        assert report.added == ()
        assert report.skipped_for_floor == bigger.length
        assert [r.span for r in report.removed] == [small.span]
        assert report.released_for_pressure == small.length
        assert pinner.pinned == [Region(0, 8 * MiB, 12.0)]
        assert vmlck() - base == 8 * MiB
    assert vmlck() == base


def test_truncate_and_grow_while_pinned(image: Path) -> None:
    base = vmlck()
    with Pinner(image, floor_bytes=0, meminfo=plenty) as pinner:
        pinner.apply([Region(2 * MiB, 20 * MiB, 1.0)], budget=SIZE)
        os.truncate(image, 5 * MiB + 100)  # drops pinned pages past the end; must not crash
        frac = scan_residency(image, BLOCK).fraction
        assert frac.shape == (6,) and frac[2:].min() == 1.0
        report = pinner.apply([Region(2 * MiB, 20 * MiB, 1.0)], budget=SIZE)
        assert [r.span for r in report.regions] == [(2 * MiB, 3 * MiB + PAGE_SIZE)]  # clipped, page rounded
        assert vmlck() - base == 3 * MiB + PAGE_SIZE
        # grow back: the clipped pin follows the file
        os.truncate(image, 40 * MiB)
        report = pinner.apply([Region(2 * MiB, 20 * MiB, 1.0)], budget=SIZE)
        assert [r.span for r in report.regions] == [(2 * MiB, 20 * MiB)]
        assert vmlck() - base == 20 * MiB
        # a region wholly past the end is simply not pinned
        os.truncate(image, 1 * MiB)
        report = pinner.apply([Region(2 * MiB, 20 * MiB, 1.0)], budget=SIZE)
        assert report.regions == () and vmlck() == base


def test_release_all_and_close_restore_vmlck(image: Path) -> None:
    base = vmlck()
    pinner = Pinner(image, floor_bytes=0, meminfo=plenty)
    pinner.apply([Region(0, 8 * MiB, 1.0), Region(16 * MiB, 8 * MiB, 2.0)], budget=SIZE)
    assert vmlck() - base == 16 * MiB
    pinner.release_all()
    assert vmlck() == base and pinner.pinned == [] and pinner.pinned_bytes == 0
    pinner.apply([Region(0, 8 * MiB, 1.0)], budget=SIZE)
    pinner.close()
    assert vmlck() == base
    with pytest.raises(PinError):
        pinner.apply([Region(0, 8 * MiB, 1.0)], budget=SIZE)


def test_one_failure_does_not_lose_the_others(image: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = locking.mlock

    def flaky(addr: int, length: int) -> None:
        if length == 3 * MiB:
            raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))
        real(addr, length)

    monkeypatch.setattr(locking, "mlock", flaky)
    base = vmlck()
    with Pinner(image, floor_bytes=0, meminfo=plenty) as pinner:
        with pytest.raises(PinError) as info:
            pinner.apply([Region(0, 2 * MiB, 3.0), Region(4 * MiB, 3 * MiB, 2.0), Region(8 * MiB, 1 * MiB, 1.0)], SIZE)
        assert info.value.errno == errno.ENOMEM
        report = info.value.report  # type: ignore[attr-defined]
        assert [f.start for f in report.failures] == [4 * MiB]
        assert [r.span for r in pinner.pinned] == [(0, 2 * MiB), (8 * MiB, 1 * MiB)]
        assert vmlck() - base == 3 * MiB
    assert vmlck() == base


def test_missing_image(tmp_path: Path) -> None:
    with pytest.raises(PinError) as info:
        Pinner(tmp_path / "nope.img", floor_bytes=0)
    assert info.value.errno == errno.ENOENT


def _read_pages(path: Path, pages: Iterable[int]) -> None:
    with open(path, "rb", buffering=0) as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)  # these pages and no read-around
        for page in pages:
            os.pread(f.fileno(), 1, page * PAGE_SIZE)


def _cached_pages(path: Path) -> np.ndarray:
    return scan_residency(path, PAGE_SIZE).blocks.index


def test_fill_cached_locks_the_cached_pages_and_reads_nothing(image: Path) -> None:
    """``fill: cached``: a pin locks what the guest read, then what it reads next; never a page more."""
    base, base_vmlck = locked_pages(), vmlck()
    first = 4 * MiB // PAGE_SIZE
    _read_pages(image, range(first, first + 512, 4))  # every fourth page of 2 MiB
    assert _cached_pages(image).tolist() == list(range(first, first + 512, 4))
    with Pinner(image, floor_bytes=0, meminfo=plenty) as pinner:
        report = pinner.apply([Region(4 * MiB, 2 * MiB, 1.0)], budget=SIZE, fill=False)
        assert report.pinned_bytes == 2 * MiB  # the budget counts the pin whole, and so does VmLck
        assert vmlck() - base_vmlck == 2 * MiB
        assert locked_pages() - base == 128 * PAGE_SIZE
        assert report.locked_bytes == pinner.locked_bytes == 128 * PAGE_SIZE  # what it holds, reported
        assert _cached_pages(image).tolist() == list(range(first, first + 512, 4))  # nothing read
        drop(image)  # locked: they stay
        assert _cached_pages(image).tolist() == list(range(first, first + 512, 4))
        _read_pages(image, range(first + 1, first + 512, 4))  # the guest reads on, inside the pin
        _read_pages(image, [first + 600])                      # and beside it
        assert pinner.lock_cached() == []
        assert locked_pages() - base == 256 * PAGE_SIZE
        assert pinner.locked_bytes == 256 * PAGE_SIZE
        drop(image)
        assert _cached_pages(image).size == 256  # the page beside was not locked
        assert Path("/proc/self/maps").read_text().count(str(image)) == 1  # locked on fault: one mapping, however scattered its pages
    assert locked_pages() == base and vmlck() == base_vmlck


def test_a_trim_whose_unmap_fails_pins_the_region_anew(image: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vmcache.host import pintable

    base = vmlck()
    real, calls = pintable.unmap, []  # type: ignore[attr-defined]

    def unmap_failing_once(addr: int, length: int) -> None:
        calls.append(length)
        if len(calls) == 1:
            raise OSError(errno.ENOMEM, "no memory")
        real(addr, length)

    with Pinner(image, floor_bytes=0, meminfo=plenty) as pinner:
        pinner.apply([Region(4 * MiB, 12 * MiB, 1.0)], budget=SIZE)
        monkeypatch.setattr(pintable, "unmap", unmap_failing_once)
        trimmed = Region(6 * MiB, 8 * MiB, 1.0)
        report = pinner.apply([trimmed], budget=SIZE)
        assert report.added == (trimmed,) and [r.span for r in pinner.pinned] == [trimmed.span]
        assert vmlck() - base == 8 * MiB
    assert vmlck() == base
