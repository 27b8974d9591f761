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

import numpy as np

__all__ = ["PageRefs"]

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
