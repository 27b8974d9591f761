"""Residency scans of real files in the real page cache.

Pages meant to be resident are written and left dirty (not fsynced): this
host's kernel reclaims clean page cache proactively (DAMON pageout), but
not dirty pages, which stay for dirty_expire_centisecs (30 s). Pages meant
to be absent are written, fsynced and dropped with POSIX_FADV_DONTNEED, or
never written at all (holes of a sparse file).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest

from vmcache.errors import ConfigError, PageCacheError
from vmcache.host import cachestat, pagecache
from vmcache.host.pagecache import PAGE_SIZE, scan_residency

MiB = 1 << 20
BLOCK = 1 * MiB


def _make_image(path: Path, size: int, resident: list[tuple[int, int]], dropped: list[tuple[int, int]]) -> None:
    """Sparse file of ``size``; ``dropped`` written then evicted, ``resident`` written and left dirty."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, size)
        for off, length in dropped:
            os.pwrite(fd, b"\x5a" * length, off)
        os.fsync(fd)
        for off, length in dropped:
            os.posix_fadvise(fd, off, length, os.POSIX_FADV_DONTNEED)
        for off, length in resident:
            os.pwrite(fd, b"\xa5" * length, off)
    finally:
        os.close(fd)


def _expected(size: int, block: int, resident: list[tuple[int, int]]) -> np.ndarray:
    """Reference per-block fractions computed page by page, the slow obvious way."""
    npages = -(-size // PAGE_SIZE)
    pages = [False] * npages
    for off, length in resident:
        for p in range(off // PAGE_SIZE, -(-(off + length) // PAGE_SIZE)):
            pages[p] = True
    ppb = block // PAGE_SIZE
    out = []
    for b in range(-(-size // block)):
        blk = pages[b * ppb : (b + 1) * ppb]
        out.append(sum(blk) / len(blk))
    return np.array(out, dtype=np.float32)


# 40 MiB + a partial last block of 3 pages and a bit; chunk of 4 MiB in the
# scans below, so ranges fall fully inside chunks, across chunk borders and
# in the partial tail.
SIZE = 40 * MiB + 3 * PAGE_SIZE + 100
RESIDENT = [
    (0, 2 * MiB),  # whole blocks 0-1
    (5 * MiB + 8 * PAGE_SIZE, 64 * PAGE_SIZE),  # a quarter of block 5
    (11 * MiB, 6 * MiB),  # blocks 11-16, across the 12 MiB and 16 MiB chunk borders
    (40 * MiB, PAGE_SIZE),  # one of the four pages of the last block
]
DROPPED = [(2 * MiB, 3 * MiB), (5 * MiB + 200 * PAGE_SIZE, 10 * PAGE_SIZE), (40 * MiB + PAGE_SIZE, 2 * PAGE_SIZE)]


@pytest.fixture
def image(tmp_path: Path) -> Path:
    path = tmp_path / "disk.img"
    _make_image(path, SIZE, RESIDENT, DROPPED)
    return path


@pytest.mark.parametrize("use_cachestat", [None, False])
def test_per_block_fractions_match_the_resident_ranges(image: Path, use_cachestat: bool | None) -> None:
    if use_cachestat is None and not pagecache.cachestat_supported():
        pytest.skip("kernel without cachestat")
    res = scan_residency(image, BLOCK, chunk=4 * MiB, use_cachestat=use_cachestat)
    want = _expected(SIZE, BLOCK, RESIDENT)
    assert res.size_bytes == SIZE
    assert res.page_size == PAGE_SIZE
    assert res.nblocks == 41
    assert res.fraction.dtype == np.float32
    np.testing.assert_array_equal(res.fraction, want)
    assert res.fraction[5] == pytest.approx(0.25)
    assert res.fraction[40] == pytest.approx(0.25)  # 1 of the last block's 4 real pages
    assert res.resident_pages == sum(-(-n // PAGE_SIZE) for _, n in RESIDENT)
    assert res.resident_bytes == res.resident_pages * PAGE_SIZE


def test_cachestat_and_mincore_agree_for_several_block_sizes(image: Path) -> None:
    if not pagecache.cachestat_supported():
        pytest.skip("kernel without cachestat")
    for block in (PAGE_SIZE, 64 << 10, 3 * MiB):
        fast = scan_residency(image, block, chunk=2 * MiB)
        slow = scan_residency(image, block, use_cachestat=False)
        assert fast.method == "cachestat" and slow.method == "mincore"
        np.testing.assert_array_equal(fast.fraction, slow.fraction)
        np.testing.assert_array_equal(fast.fraction, _expected(SIZE, block, RESIDENT))
        assert fast.resident_pages == slow.resident_pages


def test_cachestat_counters_cover_the_whole_file(image: Path) -> None:
    if not pagecache.cachestat_supported():
        pytest.skip("kernel without cachestat")
    res = scan_residency(image, BLOCK)
    assert res.nr_cache == res.resident_pages
    assert res.nr_dirty == res.resident_pages  # written, never synced
    # pages dropped with fadvise leave no shadow entry, only reclaim does: just present
    assert isinstance(res.nr_evicted, int) and isinstance(res.nr_recently_evicted, int)
    slow = scan_residency(image, BLOCK, use_cachestat=False)
    assert slow.nr_dirty is None and slow.nr_evicted is None


def test_scattered_and_clustered_residency(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages scattered over one part of the file (read as merged mincore windows), runs in another."""
    path = tmp_path / "mixed.img"
    size = 96 * MiB + 5 * PAGE_SIZE
    scattered = [(off, 16 * PAGE_SIZE) for off in range(0, 48 * MiB, 3 * 64 * 1024)]
    runs = [(50 * MiB + 12 * PAGE_SIZE, 9 * MiB), (80 * MiB, 16 * MiB + 5 * PAGE_SIZE)]
    _make_image(path, size, scattered + runs, [])
    monkeypatch.setattr(pagecache, "_WINDOW", 8 * MiB)  # several windows, merged and cut
    for block in (PAGE_SIZE, 256 << 10, BLOCK):
        want = _expected(size, block, scattered + runs)
        for chunk in (PAGE_SIZE * 64, 1 * MiB, 4 * MiB):
            res = scan_residency(path, block, chunk=chunk)
            np.testing.assert_array_equal(res.fraction, want, err_msg=f"block {block} chunk {chunk}")
            assert res.resident_pages == sum(n // PAGE_SIZE for _, n in scattered + runs)
        np.testing.assert_array_equal(scan_residency(path, block, use_cachestat=False).fraction, want)


def test_fully_cached_file_is_all_ones(tmp_path: Path) -> None:
    path = tmp_path / "full.img"
    _make_image(path, 9 * MiB + PAGE_SIZE, [(0, 9 * MiB + PAGE_SIZE)], [])
    res = scan_residency(path, 2 * MiB, chunk=4 * MiB)
    np.testing.assert_array_equal(res.fraction, np.ones(5, dtype=np.float32))
    assert res.resident_pages == (9 * MiB + PAGE_SIZE) // PAGE_SIZE


def test_sparse_terabyte_with_a_little_resident(tmp_path: Path) -> None:
    path = tmp_path / "big.img"
    size = 1 << 40
    hot = [(5 << 30, 8 * MiB), (size - 4 * MiB, 4 * MiB)]
    _make_image(path, size, hot, [])
    res = scan_residency(path, 64 * MiB)
    assert res.nblocks == size // (64 * MiB)
    assert res.resident_pages == 12 * MiB // PAGE_SIZE
    nonzero = np.flatnonzero(res.fraction)
    assert list(nonzero) == [(5 << 30) // (64 * MiB), res.nblocks - 1]
    assert res.fraction[nonzero].tolist() == [0.125, 0.0625]
    # the scan's own answer lists the two resident blocks, nothing over the rest of the terabyte
    assert res.blocks.index.tolist() == list(nonzero) and res.blocks.value.tolist() == [0.125, 0.0625]


def test_fd_is_used_and_left_open(image: Path) -> None:
    fd = os.open(image, os.O_RDONLY)
    try:
        res = scan_residency("named-for-errors", BLOCK, fd=fd)
        np.testing.assert_array_equal(res.fraction, _expected(SIZE, BLOCK, RESIDENT))
        os.fstat(fd)  # still open
    finally:
        os.close(fd)


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.img"
    path.touch()
    for use in (None, False):
        res = scan_residency(path, BLOCK, use_cachestat=use)
        assert res.nblocks == 0 and res.resident_pages == 0 and res.resident_percent == 0.0


def test_missing_file_raises_page_cache_error(tmp_path: Path) -> None:
    with pytest.raises(PageCacheError) as info:
        scan_residency(tmp_path / "nope.img", BLOCK)
    assert info.value.errno == errno.ENOENT
    assert info.value.path == str(tmp_path / "nope.img")
    assert "nope.img" in str(info.value)


def test_block_size_must_be_whole_pages(image: Path) -> None:
    with pytest.raises(ConfigError):
        scan_residency(image, PAGE_SIZE + 512)
    with pytest.raises(ConfigError):
        scan_residency(image, 0)


def test_required_cachestat_missing_is_an_error(image: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cachestat, "_supported", False)
    with pytest.raises(PageCacheError):
        scan_residency(image, BLOCK, use_cachestat=True)
    # auto falls back to mincore and still gives the right answer
    res = scan_residency(image, BLOCK)
    assert res.method == "mincore"
    np.testing.assert_array_equal(res.fraction, _expected(SIZE, BLOCK, RESIDENT))


def test_cachestat_of_a_range(image: Path) -> None:
    if not pagecache.cachestat_supported():
        pytest.skip("kernel without cachestat")
    fd = os.open(image, os.O_RDONLY)
    try:
        assert pagecache.cachestat(fd, 11 * MiB, 6 * MiB).nr_cache == 6 * MiB // PAGE_SIZE
        assert pagecache.cachestat(fd, 20 * MiB, 10 * MiB).nr_cache == 0
    finally:
        os.close(fd)
    with pytest.raises(PageCacheError) as info:
        pagecache.cachestat(fd, 0, 0, path="closed")
    assert info.value.errno == errno.EBADF


def test_cli_scan_json(image: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from vmcache.cli import main

    assert main(["scan", str(image), "--json", "--blocks", "--block-size", "1M"]) == 0
    out = json.loads(capsys.readouterr().out)
    pages = sum(-(-n // PAGE_SIZE) for _, n in RESIDENT)
    assert out["size_bytes"] == SIZE
    assert out["page_size"] == PAGE_SIZE
    assert out["resident_pages"] == pages
    assert out["resident_bytes"] == pages * PAGE_SIZE
    assert out["blocks"] == 41
    assert out["blocks_full"] == 8  # blocks 0-1 and 11-16
    assert out["blocks_resident"] == 10  # plus block 5 and the last block
    if out["method"] == "cachestat":
        assert out["nr_dirty"] == pages and out["nr_cache"] == pages
    assert main(["scan", str(image), "--json", "--method", "mincore"]) == 0
    assert json.loads(capsys.readouterr().out)["resident_pages"] == pages


def test_cli_scan_human_and_errors(image: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from vmcache.cli import main

    assert main(["scan", str(image)]) == 0
    out = capsys.readouterr().out
    pages = sum(-(-n // PAGE_SIZE) for _, n in RESIDENT)
    assert f"Resident Pages: {pages}/{-(-SIZE // PAGE_SIZE)}" in out
    assert main(["scan", str(tmp_path / "missing.img")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing.img" in err[0] and "No such file" in err[0]
    assert main(["scan", str(image), "--block-size", "6000"]) == 2
    assert "--block-size" in capsys.readouterr().err


def test_a_scan_started_from_the_previous_one_finds_the_same_and_what_moved(tmp_path: Path) -> None:
    """The hint only changes where the cachestat pass starts: pages gone, grown or new are all found."""
    path = tmp_path / "moving.img"
    size = 64 * MiB + 7 * PAGE_SIZE
    before = [(3 * MiB, 5 * MiB), (20 * MiB + 4 * PAGE_SIZE, 40 * PAGE_SIZE), (50 * MiB, 2 * MiB)]
    _make_image(path, size, before, [])
    first = scan_residency(path, BLOCK, chunk=MiB)
    assert first.populated and all(0 <= a < b <= size for a, b in first.populated)
    fd = os.open(path, os.O_RDWR)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 50 * MiB, 2 * MiB, os.POSIX_FADV_DONTNEED)  # gone
        now = [(3 * MiB, 6 * MiB), (20 * MiB + 4 * PAGE_SIZE, 40 * PAGE_SIZE), (40 * MiB, 3 * PAGE_SIZE),
               (64 * MiB, 7 * PAGE_SIZE)]  # grown, kept, new in a gap, new in the partial tail
        for off, length in now:
            os.pwrite(fd, b"\x77" * length, off)
    finally:
        os.close(fd)
    hinted = scan_residency(path, BLOCK, chunk=MiB, hint=first)
    plain = scan_residency(path, BLOCK, chunk=MiB)
    np.testing.assert_array_equal(hinted.fraction, _expected(size, BLOCK, now))
    np.testing.assert_array_equal(hinted.fraction, plain.fraction)
    assert hinted.resident_pages == plain.resident_pages


def test_a_scan_started_from_the_previous_one_asks_the_kernel_far_less(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "big.img"
    size = 1 << 40
    _make_image(path, size, [(5 << 30, 8 * MiB + 3 * PAGE_SIZE), (700 << 30, 4 * MiB)], [])
    calls: list[tuple[int, int, int]] = []
    raw = cachestat._raw_cachestat

    def counting(fd: int, offset: int, length: int) -> cachestat.CacheStat:
        calls.append((fd, offset, length))
        return raw(fd, offset, length)

    monkeypatch.setattr(pagecache, "_raw_cachestat", counting)
    first = scan_residency(path, MiB)
    cold = len(calls)
    calls.clear()
    again = scan_residency(path, MiB, hint=first)
    np.testing.assert_array_equal(again.blocks.index, first.blocks.index)
    np.testing.assert_array_equal(again.blocks.value, first.blocks.value)
    assert len(calls) * 4 < cold, (len(calls), cold)  # one call per range and gap, not a descent per level
