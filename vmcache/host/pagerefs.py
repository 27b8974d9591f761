"""Which pinned pages the guest read: the pages' referenced bits (/proc/kpageflags).

A read of a page-cache page (QEMU's pread of the image) sets its
PG_referenced flag, also when the page is mlocked; writing ``1`` to
``/proc/self/clear_refs`` clears the flag of every page mapped by this
process. So between two clears, the referenced bit of a page vmcache has
pinned says whether anything read it - the evidence mincore cannot give
for pages that never leave the cache. Reading a page's flags takes its PFN
from ``/proc/self/pagemap`` (root only: without CAP_SYS_ADMIN the kernel
reports PFN 0, and there is no evidence).

Verified on the project's kernel (6.18): after a clear, the 100 pages of a
locked 16 MiB mapping read by pread through another descriptor were exactly
the referenced ones (tests/unit/test_pagerefs.py). The flag is kept per
folio: where the page cache holds a file in large folios (up to 2 MiB,
made by large writes or readahead), a read marks the whole folio, so the
evidence has that resolution. mlock's own faulting marks pages referenced
too, so the caller clears after pinning.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from ..model.blocks import BlockValues
from .pagecache import PAGE_SIZE

__all__ = ["PageRefs", "read_evidence"]

_PFN_MASK = (1 << 55) - 1
_PRESENT = 1 << 63
_KPF_REFERENCED = 1 << 2


def _read_flags(kflags: int, pfns: np.ndarray) -> np.ndarray | None:
    """The kpageflags word of each PFN (one 8-byte pread each); None when the file cannot be read.

    The kernel answers ~0.6 us per entry read, so reading the span between
    two sampled PFNs would cost more than a call per PFN; the loop is kept
    to the call itself.
    """
    try:
        words = b"".join([os.pread(kflags, 8, offset) for offset in (pfns * 8).tolist()])
    except OSError:
        return None
    if len(words) != 8 * pfns.size:
        return None
    return np.frombuffer(words, dtype=np.uint64)


class PageRefs:
    """Referenced bits of this process's mapped pages; paths are arguments for tests."""

    def __init__(self, *, pagemap: str = "/proc/self/pagemap", kpageflags: str = "/proc/kpageflags",
                 clear_refs: str = "/proc/self/clear_refs", page_size: int = os.sysconf("SC_PAGESIZE")) -> None:
        self._paths = (pagemap, kpageflags, clear_refs)
        self.page_size = page_size
        self._fds: tuple[int, int] | None = None
        self.available = True

    def _open(self) -> tuple[int, int] | None:
        if self._fds is None and self.available:
            try:
                pagemap = os.open(self._paths[0], os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                self.available = False
                return None
            try:
                flags = os.open(self._paths[1], os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                os.close(pagemap)
                self.available = False
                return None
            self._fds = (pagemap, flags)
        return self._fds

    def referenced(self, addr: int, pages: np.ndarray) -> np.ndarray | None:
        """For page indexes ``pages`` of the mapping at ``addr``: referenced since the last clear.

        None when the kernel gives no PFNs (not root) or the files cannot be
        read; pages not present count as not referenced.
        """
        fds = self._open()
        if fds is None or len(pages) == 0:
            return None if fds is None else np.zeros(0, dtype=bool)
        pagemap, kflags = fds
        first, last = int(pages.min()), int(pages.max())
        try:
            raw = os.pread(pagemap, (last - first + 1) * 8, (addr // self.page_size + first) * 8)
        except OSError:
            return None
        entries = np.frombuffer(raw, dtype=np.uint64)[pages - first]
        present = (entries & np.uint64(_PRESENT)) != 0
        pfns = entries & np.uint64(_PFN_MASK)
        if present.any() and not pfns[present].any():
            self.available = False  # PFNs hidden: not root
            return None
        out = np.zeros(len(pages), dtype=bool)
        where = np.flatnonzero(present)
        flags = _read_flags(kflags, pfns[where].astype(np.int64))
        if flags is None:
            return None
        out[where] = (flags & np.uint64(_KPF_REFERENCED)) != 0
        return out

    def clear(self) -> None:
        """Clear the referenced bits of every page this process maps (no-op when unavailable)."""
        if not self.available:
            return
        try:
            with open(self._paths[2], "w") as f:
                f.write("1")
        except OSError:
            self.available = False

    def close(self) -> None:
        if self._fds is not None:
            for fd in self._fds:
                os.close(fd)
            self._fds = None


def read_evidence(mappings: Sequence[tuple[int, int, int]], block_size: int, nblocks: int, refs: PageRefs, *,
                  per_block: int = 16, phase: int = 0) -> BlockValues:
    """For the blocks of the pinned ``mappings`` (file offset, length, address each), the fraction of their
    sampled pages read since ``refs`` was last cleared.

    Blocks not pinned are not listed, and none are when the kernel gives
    no evidence. ``per_block`` pages are sampled from each pinned block, one
    at random in each of ``per_block`` equal strides (``phase`` seeds the
    draw: vary it between calls). A sample at a fixed place in each stride
    aliases strided reads: a guest reading one page in 16 was seen reading
    all of a block or none of it, and its pins were released while it read
    them.
    """
    index: list[np.ndarray] = []
    values: list[np.ndarray] = []
    per_page = block_size // PAGE_SIZE
    step = max(1, per_page // per_block)
    strides = np.arange(0, per_page, step)
    rng = np.random.default_rng(phase)
    for start, length, addr in mappings:
        npages = length // PAGE_SIZE
        first_block = start // block_size
        offsets = np.arange(first_block * block_size, start + length, block_size, dtype=np.int64)
        sample = strides[None, :] + rng.integers(0, step, size=(len(offsets), strides.size))
        idx = ((offsets - start) // PAGE_SIZE)[:, None] + sample  # pages of the mapping; a block's own only
        block_of = np.repeat(np.arange(len(offsets)), idx.shape[1])
        idx = idx.ravel()
        keep = (idx >= 0) & (idx < npages)
        block_of, idx = block_of[keep], idx[keep]
        hits = refs.referenced(addr, idx)
        if hits is None:
            return BlockValues.empty()
        sampled = np.bincount(block_of, minlength=len(offsets))
        read = np.bincount(block_of, weights=hits, minlength=len(offsets))
        blocks = first_block + np.arange(len(offsets), dtype=np.int64)
        ok = (sampled > 0) & (blocks < nblocks)
        index.append(blocks[ok])
        values.append((read[ok] / sampled[ok]).astype(np.float32))
    if not any(part.size for part in index):
        return BlockValues.empty()
    blocks, fractions = np.concatenate(index), np.concatenate(values)
    order = np.argsort(blocks, kind="stable")
    blocks, fractions = blocks[order], fractions[order]
    last = np.append(blocks[1:] != blocks[:-1], True)  # a block two pins share: the later pin's
    return BlockValues(blocks[last], fractions[last])
