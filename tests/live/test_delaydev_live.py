"""The bench's delay device (bench/delaydev.py) on the real kernel: the page cache sits above the delay.

Hits never reach the daemon (its own request counters say so), the cache
survives reopening, it is charged to the reader's memory cgroup and
reclaimed by ``memory.force_empty``, evicted by fadvise DONTNEED, and
pages locked with mmap + mlock stay through both. No timing assertions:
the device check of the bench measures the latencies.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.e2e_host import DEVICES, Cgroup, delay_stats, mount_delay, unmount_delay
from vmcache.host.cachestat import cachestat

pytestmark = pytest.mark.live

MIB = 1 << 20
PAGES = MIB // 4096


def backing_dir(tmp_path: Path, image: bytes) -> Path:
    """A backing directory holding ``img.raw`` (skips where FUSE cannot be mounted)."""
    if os.geteuid() != 0 or not Path("/dev/fuse").exists():
        pytest.skip("needs root and /dev/fuse")
    pytest.importorskip("pyfuse3")
    backing = tmp_path / "backing"
    backing.mkdir()
    (backing / "img.raw").write_bytes(image)
    return backing


@pytest.fixture
def device(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """(image through the delay device, the stats file); everything unmounted and removed after."""
    backing = backing_dir(tmp_path, os.urandom(8 * MIB))
    mount, stats = tmp_path / "mnt", tmp_path / "stats.json"
    proc = mount_delay(DEVICES["ssd"], backing, mount, stats)
    try:
        yield mount / "img.raw", stats
    finally:
        unmount_delay(proc, mount)
    assert not os.path.ismount(mount) and not mount.exists()


def counters(stats: Path) -> dict[str, int]:
    time.sleep(1.1)    # the daemon writes its counters every 0.5 s
    return delay_stats(stats)


def cache(path: Path, offset: int, length: int) -> tuple[int, int]:
    """(pages cached, pages evicted since they were cached) of the range: cachestat(2)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        c = cachestat(fd, offset, length)
        return c.nr_cache, c.nr_evicted
    finally:
        os.close(fd)


def cached_pages(path: Path, offset: int, length: int) -> int:
    return cache(path, offset, length)[0]


def read(path: Path, offset: int, length: int, cg: Cgroup | None = None) -> None:
    """dd of the range, in ``cg`` when given (its page cache is charged there)."""
    dd = f"exec dd if={path} of=/dev/null bs=64k skip={offset // 65536} count={length // 65536} status=none"
    subprocess.run(["sh", "-c", (cg.shell_prefix() if cg else "") + dd], check=True)


def read_no_readahead(path: Path, offset: int, length: int) -> None:
    """Read the range through a new open with readahead off, so a hit cannot start an async read beyond it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        for at in range(offset, offset + length, 65536):
            os.pread(fd, 65536, at)
    finally:
        os.close(fd)


def test_hits_never_reach_the_daemon_and_the_cache_survives_reopening(device: tuple[Path, Path]) -> None:
    image, stats = device
    read_no_readahead(image, 0, MIB)
    first = counters(stats)
    assert first["read_bytes"] >= MIB and sum(cache(image, 0, MIB)) == PAGES
    # the host's own proactive reclaim (DAMON here) may take a page before the second read: that page is
    # read again, one request at most. Without keep_cache the new open drops all of them: 16 requests.
    missing = PAGES - cached_pages(image, 0, MIB)
    read_no_readahead(image, 0, MIB)
    assert counters(stats)["reads"] - first["reads"] <= missing
    read_no_readahead(image, 4 * MIB, MIB)      # a miss elsewhere does reach it
    assert counters(stats)["reads"] > first["reads"]


def test_cache_is_charged_to_the_reader_reclaimed_and_evicted_but_locked_pages_stay(
        device: tuple[Path, Path]) -> None:
    image, stats = device
    cg = Cgroup("memory", f"vmcache-test-delaydev-{os.getpid()}")
    cg.create()
    locker = None
    try:
        read(image, 0, 4 * MIB, cg)
        stat = dict(line.split() for line in cg.read("memory.stat").splitlines())
        assert int(stat["cache"]) >= 4 * MIB
        cg.write("memory.force_empty", 0)
        assert cached_pages(image, 0, 4 * MIB) == 0
        locker = subprocess.Popen(["sh", "-c", cg.shell_prefix() + f"exec vmtouch -q -l -p 0-{MIB} {image}"])
        deadline = time.monotonic() + 60
        while cached_pages(image, 0, MIB) < PAGES and time.monotonic() < deadline:
            time.sleep(0.2)
        read(image, 2 * MIB, MIB, cg)
        cg.write("memory.force_empty", 0)
        subprocess.run(["vmtouch", "-q", "-e", str(image)], check=True)   # fadvise DONTNEED
        assert cached_pages(image, 0, MIB) == PAGES        # locked: unevictable
        assert cached_pages(image, 2 * MIB, MIB) == 0      # not locked: gone
    finally:
        if locker is not None:
            locker.terminate()
            locker.wait()
        cg.remove()


def test_writes_and_fsync_pass_through_to_the_backing_file(device: tuple[Path, Path]) -> None:
    image, stats = device
    data = os.urandom(8192)
    fd = os.open(image, os.O_RDWR)
    try:
        os.pwrite(fd, data, MIB)
        os.fdatasync(fd)
    finally:
        os.close(fd)
    backing = image.parent.parent / "backing" / image.name
    with open(backing, "rb") as f:
        f.seek(MIB)
        assert f.read(8192) == data
    c = counters(stats)
    assert c["write_bytes"] >= 8192 and c["fsyncs"] >= 1


def test_a_flush_with_a_set_cost_takes_that_time_and_the_write_still_reaches_every_reader(tmp_path: Path) -> None:
    backing = backing_dir(tmp_path, bytes(MIB))
    mount, stats = tmp_path / "mnt", tmp_path / "stats.json"
    proc = mount_delay(dataclasses.replace(DEVICES["ssd"], fsync_ms=200.0), backing, mount, stats)
    try:
        data = os.urandom(4096)
        fd = os.open(mount / "img.raw", os.O_RDWR)
        try:
            os.pwrite(fd, data, 8192)
            took = time.monotonic()
            os.fdatasync(fd)
            took = time.monotonic() - took
        finally:
            os.close(fd)
        assert took >= 0.2   # the set cost, whatever the disk under the backing file takes
        with open(backing / "img.raw", "rb") as f:
            f.seek(8192)
            assert f.read(4096) == data
        assert counters(stats)["fsyncs"] >= 1
    finally:
        unmount_delay(proc, mount)


def test_the_daemon_exits_when_its_mount_is_unmounted(tmp_path: Path) -> None:
    """``umount`` by anyone (a test's cleanup, an operator) ends the daemon: none is left serving nothing."""
    backing = backing_dir(tmp_path, bytes(MIB))
    mount = tmp_path / "mnt"
    proc = mount_delay(DEVICES["ssd"], backing, mount, tmp_path / "stats.json")
    try:
        subprocess.run(["umount", str(mount)], check=True)
        assert proc.wait(timeout=30) == 0
    finally:
        unmount_delay(proc, mount)


def _pread(path: Path, offset: int, length: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, length, offset)
    finally:
        os.close(fd)


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_two_mounts_of_one_directory_have_their_own_page_caches_and_a_mapped_page_outlives_dontneed(
        tmp_path: Path) -> None:
    """How two hosts see one NFS export or shared LUN (make test-migrate's hosts): a page read through mount
    A is not resident through mount B; a write through A reaches B only once B drops its page - and B's
    DONTNEED (what QEMU does to its image when a migration activates it) cannot drop a page a process maps,
    which then serves the old bytes: why vmcache never pins on a destination before the domain runs there."""
    import mmap

    backing = backing_dir(tmp_path, b"old!" * (MIB // 4))
    procs = {side: mount_delay(DEVICES["ssd"], backing, tmp_path / f"mnt-{side}", tmp_path / f"stats-{side}.json")
             for side in "ab"}
    a, b = tmp_path / "mnt-a" / "img.raw", tmp_path / "mnt-b" / "img.raw"
    try:
        read_no_readahead(a, 0, MIB)
        assert cached_pages(a, 0, MIB) == PAGES and cached_pages(b, 0, MIB) == 0
        assert _pread(b, 0, 4) == b"old!" and _pread(b, 65536, 4) == b"old!"   # B caches both pages now
        fd = os.open(b, os.O_RDONLY)
        mapping = mmap.mmap(fd, 4096, prot=mmap.PROT_READ, offset=0)
        os.close(fd)
        try:
            assert mapping[:4] == b"old!"           # mapped in (a pin maps it the same way)
            fd = os.open(a, os.O_RDWR)
            try:
                os.pwrite(fd, b"new!", 0)
                os.pwrite(fd, b"new!", 65536)
                os.fdatasync(fd)
            finally:
                os.close(fd)
            assert _pread(b, 0, 4) == b"old!"       # B's cache is B's: not told of A's write
            _evict(b)
            assert _pread(b, 65536, 4) == b"new!"   # an unmapped page went, and is read anew
            assert _pread(b, 0, 4) == b"old!"       # the mapped one stayed: stale
        finally:
            mapping.close()
        _evict(b)
        assert _pread(b, 0, 4) == b"new!"           # once nothing maps it, a drop takes it
    finally:
        for side, proc in procs.items():
            unmount_delay(proc, tmp_path / f"mnt-{side}")
