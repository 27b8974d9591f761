"""Locking a pin's mapping in memory: whole (reading what is not cached) or only what is cached.

A pin is a read-only ``MAP_SHARED`` mapping of part of the image
(vmcache.host.pinner). :func:`load_and_lock` locks all of it, reading the
pages that are not cached from the device; :func:`lock_cached` locks only
the pages cached now and reads nothing (host config ``fill: cached``): the
pages the guest brings in later are locked when it is called again.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

from .pagecache import PAGE_SIZE, _libc

__all__ = ["drop", "lock", "load_and_lock", "lock_cached", "mlock", "munlock", "no_readaround"]

_libc.mlock.restype = ctypes.c_int
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munlock.restype = ctypes.c_int
_libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mlock2.restype = ctypes.c_int
_libc.mlock2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
_MLOCK_ONFAULT = 1
_MADV_RANDOM = 1
_MADV_POPULATE_READ = 22  # Linux 5.14
_LOAD_CHUNK = 1 << 20
_FOLIO_MAX = 2 << 20  # the largest page-cache folio on x86-64 (a PMD): a drop frees only the folios it covers whole
_ADVICE_CHUNK = 128 << 10  # the kernel's default readahead: WILLNEED reads at most max(io_pages, ra_pages) a call


def mlock(addr: int, length: int) -> None:
    """mlock(2) ``[addr, addr + length)``; OSError on failure."""
    _check(_libc.mlock(ctypes.c_void_p(addr), length))


def no_readaround(addr: int, length: int) -> None:
    """madvise(MADV_RANDOM) on a new pin's mapping, errors ignored.

    When mlock faults the range in, readahead would load pages beside the
    region, which the next scan would take for guest reads (pinning feeding
    itself).
    """
    _libc.madvise(ctypes.c_void_p(addr), length, _MADV_RANDOM)


def munlock(addr: int, length: int) -> None:
    """munlock(2) ``[addr, addr + length)``, errors ignored (munmap unlocks what is left)."""
    _libc.munlock(ctypes.c_void_p(addr), length)


def drop(fd: int, start: int, length: int) -> None:
    """Drop ``[start, start + length)`` of ``fd`` from the page cache where nothing maps or locks it.

    Each page comes back charged to the memory cgroup of whoever reads it
    next: the agent, when it loads the range at once. Errors ignored (the
    pages then keep their charge).
    """
    try:
        os.posix_fadvise(fd, start, length, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass


def lock(addr: int, length: int, fill: bool) -> int:
    """Lock the mapping at ``addr``: all of it (``fill``: its pages were loaded), else its cached pages only;
    the bytes locked. Raises OSError from mlock."""
    if fill:
        mlock(addr, length)
        return length
    return lock_cached(addr, length)


def load_and_lock(fd: int, addr: int, base: int, start: int, length: int, *, dropped: bool = False) -> None:
    """Load ``[start, start + length)`` of ``fd`` with large reads and lock it, 1 MiB at a time.

    ``addr``: the region's mapping, which begins at file offset ``base``.
    mlock of a ``MADV_RANDOM`` mapping faults each missing page in with a
    4 KiB device read of its own: on a device limited in operations per
    second (a busy SSD, network or HDD-class storage) loading a 256 MiB
    region costs 65,536 reads taken from the guest's share, where large
    reads cost a few hundred. So each MiB is first asked for with
    ``POSIX_FADV_WILLNEED`` (reads of exactly the pages not cached, in
    pieces of :data:`_ADVICE_CHUNK`, no more than the kernel reads at once
    on any device), then locked, which waits for those reads. Not read(2):
    a read through a page that another reader's readahead marked starts the
    next readahead window past it, even on a ``POSIX_FADV_RANDOM`` file,
    loading pages beside the region for nobody. What the advice did not
    load, the lock faults in. ``dropped``: each 2 MiB (the largest folio,
    aligned) is dropped from the cache (:func:`drop`) just before it is read,
    so that the guest can bring few of its pages back in between; pages
    beside the range in its first and last 2 MiB go too, unless mapped.
    Raises OSError from mlock.
    """
    end = start + length
    window = -1
    for offset in range(start, end, _LOAD_CHUNK):
        chunk = min(_LOAD_CHUNK, end - offset)
        if dropped and offset // _FOLIO_MAX != window:  # whole folios: a part of one is not dropped
            window = offset // _FOLIO_MAX
            drop(fd, window * _FOLIO_MAX, _FOLIO_MAX)
        try:
            for piece in range(offset, offset + chunk, _ADVICE_CHUNK):
                os.posix_fadvise(fd, piece, min(_ADVICE_CHUNK, offset + chunk - piece), os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        mlock(addr + offset - base, chunk)


def lock_cached(addr: int, length: int) -> int:
    """Lock the pages of the mapping ``[addr, addr + length)`` that are cached now; the bytes asked for.

    The whole mapping is locked on fault (``mlock2(MLOCK_ONFAULT)``: one
    VMA, however scattered the cached pages; locking each run of them apart
    would split it into a VMA per run, and a guest's scattered reads into
    a large budget would run into ``vm.max_map_count``), then each run of
    pages mincore finds cached is mapped in (``MADV_POPULATE_READ``), which
    locks it. Nothing is read from the device, but for a page the kernel
    evicts between the two calls (the populate reads it back). Pages locked
    before stay locked; VmLck counts the whole mapping, the locked pages are
    its resident ones (``Locked`` in /proc/PID/smaps). Raises OSError from
    mlock2, mincore or madvise.
    """
    _check(_libc.mlock2(ctypes.c_void_p(addr), length, _MLOCK_ONFAULT))
    vec = np.zeros(-(-length // PAGE_SIZE), dtype=np.uint8)
    _check(_libc.mincore(ctypes.c_void_p(addr), length, vec.ctypes.data))
    cached = np.concatenate(([0], vec & 1, [0])).astype(np.int8)
    edges = np.diff(cached)
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    for first, last in zip(starts.tolist(), ends.tolist()):
        run = min(length, last * PAGE_SIZE) - first * PAGE_SIZE
        _check(_libc.madvise(ctypes.c_void_p(addr + first * PAGE_SIZE), run, _MADV_POPULATE_READ))
    return int((ends - starts).sum()) * PAGE_SIZE


def _check(ret: int) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
