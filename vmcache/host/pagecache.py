"""Page-cache residency of an image file: cachestat(2) and mincore(2).

``scan_residency`` answers "which blocks of this file are in the page
cache, and how much of each": the blocks with resident pages and their
fractions, in sorted arrays whose size follows what is resident, not the
file's size (``Residency.fraction`` is the dense per-block view).

cachestat(2) (Linux 6.5+, bound in ``vmcache.host.cachestat``, which
needs no numpy) counts the cached pages of a byte range without mapping
anything, so it finds the populated parts of a mostly cold 1 TiB
image in a few dozen calls: ranges with no cached page are skipped, ranges
that are fully cached are filled without further work, and mincore(2) is
asked only inside the partly cached chunks. Without cachestat (older
kernel, seccomp) the whole file is read with mincore, one window at a time.

mincore needs a mapping: a read-only ``MAP_SHARED`` window of the file is
mapped, asked about and unmapped again. The mapped memory is never touched
from Python, so a file truncated meanwhile cannot SIGBUS us.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno as _errno
import os
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError, PageCacheError
from ..model.blocks import BlockValues
from .cachestat import (
    _UNSUPPORTED_ERRNOS,
    PAGE_SIZE,
    CacheStat,
    _error,
    _raw_cachestat,
    cachestat,
    cachestat_supported,
    fd_size,
)

__all__ = [
    "CacheStat",
    "Residency",
    "PAGE_SIZE",
    "DEFAULT_CHUNK",
    "cachestat",
    "cachestat_supported",
    "scan_residency",
    "map_readonly",
    "unmap",
]

# cachestat narrows partly cached ranges down to chunks of this size before
# mincore reads them page by page: mincore costs ~50 ns a page (3.5 ms for
# 256 MiB), one cachestat call a few microseconds.
DEFAULT_CHUNK = 4 << 20
_WINDOW = 1 << 30  # largest mapping used by the mincore fallback
_FANOUT = 16  # a partly cached range is split into this many parts

_PROT_READ = 0x1
_MAP_SHARED = 0x01
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.restype = ctypes.c_int
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


@dataclass(frozen=True)
class Residency:
    """Page-cache residency of one file, per block of ``block_size`` bytes.

    ``blocks``: the blocks with resident pages (sorted) and, for each, the
    fraction of its pages that are resident (the last, partial block over
    its real pages); other blocks have none. The cachestat counters cover
    the whole file; they are None when cachestat was not used.
    """

    path: str
    size_bytes: int
    page_size: int
    block_size: int
    blocks: BlockValues
    resident_pages: int
    method: str  # "cachestat" or "mincore"
    nr_cache: int | None = None
    nr_dirty: int | None = None
    nr_writeback: int | None = None
    nr_evicted: int | None = None
    nr_recently_evicted: int | None = None
    populated: tuple[tuple[int, int], ...] = ()
    """Byte ranges where the cachestat pass found pages (the next scan's hint)."""

    @property
    def nblocks(self) -> int:
        return -(-self.size_bytes // self.block_size)

    @property
    def fraction(self) -> np.ndarray:
        """Resident fraction of every block, dense (O(nblocks): for people and pictures, not the cycle)."""
        return self.blocks.to_dense(self.nblocks)

    @property
    def total_pages(self) -> int:
        return -(-self.size_bytes // self.page_size)

    @property
    def resident_bytes(self) -> int:
        """Resident pages times the page size (as fincore and vmtouch count)."""
        return self.resident_pages * self.page_size

    @property
    def resident_percent(self) -> float:
        total = self.total_pages
        return 100.0 * self.resident_pages / total if total else 0.0


def map_readonly(fd: int, offset: int, length: int) -> int:
    """mmap ``length`` bytes of ``fd`` from page-aligned ``offset``, PROT_READ, MAP_SHARED.

    Returns the address. Never read it from Python. Raises OSError.
    """
    addr = _libc.mmap(None, length, _PROT_READ, _MAP_SHARED, fd, offset)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(addr)


def unmap(addr: int, length: int) -> None:
    """munmap a mapping made by ``map_readonly``. Raises OSError."""
    if _libc.munmap(ctypes.c_void_p(addr), length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _mincore(fd: int, offset: int, length: int, vec: np.ndarray) -> np.ndarray:
    """Resident flag (0/1) of each page of ``[offset, offset+length)``; OSError on failure."""
    npages = -(-length // PAGE_SIZE)
    out = vec[:npages]
    addr = map_readonly(fd, offset, length)
    try:
        if _libc.mincore(ctypes.c_void_p(addr), length, out.ctypes.data) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
    finally:
        unmap(addr, length)
    np.bitwise_and(out, 1, out=out)  # the other bits are reserved
    return out


class _Scan:
    """One residency scan: the per-block result being filled in."""

    def __init__(self, fd: int, size: int, block_size: int) -> None:
        self.fd = fd
        self.size = size
        self.block_size = block_size
        self.ppb = block_size // PAGE_SIZE
        self.nblocks = -(-size // block_size)
        self._index: list[np.ndarray] = []
        self._values: list[np.ndarray] = []
        self.resident_pages = 0
        last_bytes = size - (self.nblocks - 1) * block_size if self.nblocks else 0
        self.last_pages = -(-last_bytes // PAGE_SIZE)
        self._vec = np.empty(0, dtype=np.uint8)

    def _buffer(self, npages: int) -> np.ndarray:
        if self._vec.shape[0] < npages:
            self._vec = np.empty(npages, dtype=np.uint8)
        return self._vec

    def fill(self, offset: int, end: int) -> None:
        """Mark the blocks of ``[offset, end)`` (block aligned, end may be EOF) fully resident."""
        b0, b1 = offset // self.block_size, -(-end // self.block_size)
        self._index.append(np.arange(b0, b1, dtype=np.int64))
        self._values.append(np.ones(b1 - b0, dtype=np.float32))
        self.resident_pages += -(-(end - offset) // PAGE_SIZE)

    def probe(self, offset: int, end: int) -> None:
        """mincore over ``[offset, end)`` (block aligned start), reduced to per-block fractions."""
        pages = _mincore(self.fd, offset, end - offset, self._buffer(-(-(end - offset) // PAGE_SIZE)))
        b0, b1 = offset // self.block_size, -(-end // self.block_size)
        nb = b1 - b0
        if pages.shape[0] != nb * self.ppb:  # the file's last block is partial: pad with zeros
            padded = np.zeros(nb * self.ppb, dtype=np.uint8)
            padded[: pages.shape[0]] = pages
            pages = padded
        counts = pages.reshape(nb, self.ppb).sum(axis=1, dtype=np.uint32)
        self.resident_pages += int(counts.sum())
        denom = np.full(nb, self.ppb, dtype=np.float32)
        if b1 == self.nblocks:
            denom[-1] = self.last_pages
        some = np.flatnonzero(counts)
        self._index.append(b0 + some.astype(np.int64))
        self._values.append((counts[some] / denom[some]).astype(np.float32))

    def result(self) -> BlockValues:
        """The resident blocks found, sorted."""
        if not self._index:
            return BlockValues.empty()
        index, values = np.concatenate(self._index), np.concatenate(self._values)
        order = np.argsort(index, kind="stable")
        return BlockValues(index[order], values[order])


def _scan_cachestat(scan: _Scan, chunk: int, hint: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """Split the file into ranges by cachestat; skip empty ones, fill full ones, mincore the rest.

    A range is split into ``_FANOUT`` parts until the parts are single
    chunks, except when every part is partly cached and the range is at
    most one mincore window or well populated (residency scattered at this
    scale: splitting further would only add calls). The partly cached
    ranges are then read with mincore, adjacent ones merged into windows.

    ``hint``: where the previous scan found pages (byte ranges). The scan
    starts from those ranges and the gaps between them instead of the whole
    file, so a residency that did not move costs a call per range (not a
    descent from the whole file through every level of the split); what
    moved is found by splitting as usual. Returns where pages were found,
    for the next scan's hint.
    """
    size = scan.size

    def pages(c0: int, c1: int) -> int:
        return -(-(min(c1 * chunk, size) - c0 * chunk) // PAGE_SIZE)

    def cached(c0: int, c1: int) -> int:
        offset = c0 * chunk
        return _raw_cachestat(scan.fd, offset, min(c1 * chunk, size) - offset).nr_cache

    nchunks = -(-size // chunk)
    window = max(1, _WINDOW // chunk)  # in chunks
    partial: list[tuple[int, int]] = []
    full: list[tuple[int, int]] = []
    stack = [(c0, c1, cached(c0, c1)) for c0, c1 in _start_ranges(hint, chunk, nchunks)]
    while stack:
        c0, c1, nr = stack.pop()
        total = pages(c0, c1)
        if nr == 0:
            continue
        if nr >= total:
            scan.fill(c0 * chunk, min(c1 * chunk, size))
            full.append((c0, c1))
            continue
        if c1 - c0 == 1:
            partial.append((c0, c1))
            continue
        step = -(-(c1 - c0) // _FANOUT)
        parts = [(c, min(c + step, c1)) for c in range(c0, c1, step)]
        kids = [(a, b, cached(a, b)) for a, b in parts]
        scattered = all(0 < n < pages(a, b) for a, b, n in kids)
        if scattered and (c1 - c0 <= window or nr * 32 >= total):
            partial.append((c0, c1))
        else:
            stack.extend(kids)
    merged = _windows(partial, window)
    for c0, c1 in merged:
        for w0 in range(c0, c1, window):
            scan.probe(w0 * chunk, min(min(w0 + window, c1) * chunk, size))
    found = sorted(_joined(sorted(full)) + [(c0, c1) for c0, c1 in merged])
    return tuple((c0 * chunk, min(c1 * chunk, size)) for c0, c1 in found)


def _windows(partial: list[tuple[int, int]], window: int) -> list[list[int]]:
    """The partly cached chunk ranges, adjacent ones merged up to ``window`` chunks: one mincore read each."""
    merged: list[list[int]] = []
    for c0, c1 in sorted(partial):
        if merged and merged[-1][1] == c0 and c1 - merged[-1][0] <= window:
            merged[-1][1] = c1
        else:
            merged.append([c0, c1])
    return merged


def _joined(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted ranges with the adjacent ones joined."""
    out: list[tuple[int, int]] = []
    for c0, c1 in ranges:
        if out and out[-1][1] == c0:
            out[-1] = (out[-1][0], c1)
        else:
            out.append((c0, c1))
    return out


def _start_ranges(hint: tuple[tuple[int, int], ...], chunk: int, nchunks: int) -> list[tuple[int, int]]:
    """The whole file in chunks, cut at the hint's ranges: each hinted range and each gap between them."""
    cuts = {0, nchunks}
    for offset, end in hint:
        cuts.add(min(max(offset // chunk, 0), nchunks))
        cuts.add(min(-(-end // chunk), nchunks))
    bounds = sorted(cuts)
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if a < b]


def _scan_mincore(scan: _Scan) -> None:
    window = max(scan.block_size, _WINDOW // scan.block_size * scan.block_size)
    for offset in range(0, scan.size, window):
        scan.probe(offset, min(offset + window, scan.size))


def scan_residency(
    path: str | os.PathLike[str],
    block_size: int,
    *,
    fd: int | None = None,
    chunk: int = DEFAULT_CHUNK,
    use_cachestat: bool | None = None,
    hint: Residency | None = None,
) -> Residency:
    """Page-cache residency of ``path``, one fraction per ``block_size`` bytes.

    ``fd``: an already-open descriptor of the file to scan instead of
    opening ``path`` (which then only names it in errors). ``chunk``: the
    granularity of the cachestat pass (rounded up to whole blocks).
    ``use_cachestat``: None = when the kernel has it, False = mincore only,
    True = cachestat required. ``hint``: the previous scan of the same
    file, to start from where it found pages (the result is the same, only
    cheaper when residency did not move much).

    Raises ConfigError for a block size that is not a positive multiple of
    the page size, PageCacheError when the file cannot be opened, mapped or
    asked (or cachestat is required and missing).
    """
    name = os.fspath(path)
    if not isinstance(block_size, int) or block_size <= 0 or block_size % PAGE_SIZE:
        raise ConfigError("block_size", block_size, f"must be a positive multiple of the page size ({PAGE_SIZE})")
    if chunk <= 0:
        raise ConfigError("chunk", chunk, "must be positive")
    chunk = -(-chunk // block_size) * block_size
    own = fd is None
    try:
        if own:
            fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as err:
        raise _error("cannot open", name, err) from err
    assert fd is not None
    try:
        return _scan(name, fd, block_size, chunk, use_cachestat, hint.populated if hint else ())
    finally:
        if own:
            os.close(fd)


def _scan(name: str, fd: int, block_size: int, chunk: int, use_cachestat: bool | None,
          hint: tuple[tuple[int, int], ...]) -> Residency:
    try:
        size = fd_size(fd)
    except OSError as err:
        raise _error("fstat", name, err) from err
    scan = _Scan(fd, size, block_size)
    whole: CacheStat | None = None
    if use_cachestat is not False and cachestat_supported(fd):
        try:
            whole = _raw_cachestat(fd, 0, 0)
        except OSError as err:
            if use_cachestat or err.errno not in (_errno.EOPNOTSUPP, *_UNSUPPORTED_ERRNOS):
                raise _error("cachestat", name, err) from err
    elif use_cachestat:
        raise PageCacheError("cachestat: not supported by this kernel", path=name, errno=_errno.ENOSYS)
    populated: tuple[tuple[int, int], ...] = ()
    try:
        if whole is not None:
            if whole.nr_cache:
                populated = _scan_cachestat(scan, chunk, hint)
        else:
            _scan_mincore(scan)
    except OSError as err:
        raise _error("residency scan", name, err) from err
    common = dict(
        path=name,
        size_bytes=size,
        page_size=PAGE_SIZE,
        block_size=block_size,
        blocks=scan.result(),
        resident_pages=scan.resident_pages,
        populated=populated,
    )
    if whole is None:
        return Residency(method="mincore", **common)  # type: ignore[arg-type]
    return Residency(
        method="cachestat",
        nr_cache=whole.nr_cache,
        nr_dirty=whole.nr_dirty,
        nr_writeback=whole.nr_writeback,
        nr_evicted=whole.nr_evicted,
        nr_recently_evicted=whole.nr_recently_evicted,
        **common,  # type: ignore[arg-type]
    )
