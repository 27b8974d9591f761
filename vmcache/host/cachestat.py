"""cachestat(2): page-cache counters of a byte range of a file, without numpy.

cachestat (Linux 6.5+) counts the cached, dirty, writeback, evicted and
recently evicted pages of ``[offset, offset+length)`` of an open file
without mapping it. One call over the whole file answers "how much of this
image is resident" in microseconds, whatever its size; this module is kept
free of numpy so that ``vmcache scan`` can answer without importing it
(and of dataclasses and platform, ~10 ms of imports together).
``vmcache.host.pagecache`` builds its per-block scan on top of it.
"""

from __future__ import annotations

import ctypes
import errno as _errno
import os
import stat as _stat
from collections import namedtuple

from ..errors import PageCacheError

__all__ = [
    "fd_size",
    "CacheStat",
    "PAGE_SIZE",
    "cachestat",
    "cachestat_supported",
    "file_cachestat",
]

PAGE_SIZE = os.sysconf("SC_PAGESIZE")

# cachestat(2) syscall numbers (include/uapi/asm-generic/unistd.h, same on x86_64).
_NR_CACHESTAT = {"x86_64": 451, "aarch64": 451, "riscv64": 451, "ppc64le": 451, "s390x": 451}.get(
    os.uname().machine
)
# cachestat errors that mean "this kernel / sandbox has no cachestat at all".
_UNSUPPORTED_ERRNOS = frozenset({_errno.ENOSYS, _errno.EPERM, _errno.EINVAL})

# The symbols already loaded into this process (libc among them): no
# ctypes.util.find_library, which runs ldconfig in a subprocess.
_syscall = ctypes.CDLL(None, use_errno=True).syscall
_syscall.restype = ctypes.c_long
_C_LONG = ctypes.c_long


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [
        ("nr_cache", ctypes.c_uint64),
        ("nr_dirty", ctypes.c_uint64),
        ("nr_writeback", ctypes.c_uint64),
        ("nr_evicted", ctypes.c_uint64),
        ("nr_recently_evicted", ctypes.c_uint64),
    ]


class CacheStat(namedtuple("CacheStat", "nr_cache nr_dirty nr_writeback nr_evicted nr_recently_evicted")):
    """cachestat(2) counters of a byte range, in pages (immutable, fields by name).

    A named tuple rather than a dataclass: importing dataclasses costs
    ~10 ms, a tenth of what ``vmcache scan`` may spend in all.
    """

    __slots__ = ()

    nr_cache: int
    nr_dirty: int
    nr_writeback: int
    nr_evicted: int
    nr_recently_evicted: int


def fd_size(fd: int) -> int:
    """Bytes of the open image: a file's length, a block device's size (fstat says 0 for those).

    Raises OSError.
    """
    st = os.fstat(fd)
    if _stat.S_ISBLK(st.st_mode):
        return os.lseek(fd, 0, os.SEEK_END)
    return st.st_size


def _error(what: str, path: str, err: OSError) -> PageCacheError:
    reason = os.strerror(err.errno) if err.errno else str(err)
    return PageCacheError(f"{what}: {reason}", path=path, errno=err.errno)


def _raw_cachestat(fd: int, offset: int, length: int) -> CacheStat:
    """cachestat(2) of ``[offset, offset+length)`` (length 0 = to EOF); OSError on failure."""
    if _NR_CACHESTAT is None:
        raise OSError(_errno.ENOSYS, os.strerror(_errno.ENOSYS))
    rng = _CachestatRange(offset, length)
    out = _Cachestat()
    # syscall(2) is variadic: pass every argument as a full long.
    if _syscall(_C_LONG(_NR_CACHESTAT), _C_LONG(fd), ctypes.byref(rng), ctypes.byref(out), _C_LONG(0)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return CacheStat(out.nr_cache, out.nr_dirty, out.nr_writeback, out.nr_evicted, out.nr_recently_evicted)


_supported: bool | None = None


def cachestat_supported(fd: int | None = None) -> bool:
    """Whether this kernel (and sandbox) answers cachestat(2); probed once, then cached.

    ``fd`` is a regular file to probe with; without one /proc/self/exe is used.
    Raises OSError only when /proc/self/exe cannot be opened.
    """
    global _supported
    if _supported is None:
        own = fd is None
        probe_fd = os.open("/proc/self/exe", os.O_RDONLY) if fd is None else fd
        try:
            _raw_cachestat(probe_fd, 0, PAGE_SIZE)
            _supported = True
        except OSError as err:
            if err.errno in _UNSUPPORTED_ERRNOS:
                _supported = False
            else:  # e.g. EOPNOTSUPP for this one file (hugetlbfs): decide later
                return True
        finally:
            if own:
                os.close(probe_fd)
    return _supported


def cachestat(fd: int, offset: int = 0, length: int = 0, *, path: str = "") -> CacheStat:
    """cachestat(2) counters of ``length`` bytes from ``offset`` (0 = to EOF).

    Raises PageCacheError (with the errno; ENOSYS when unsupported).
    """
    try:
        return _raw_cachestat(fd, offset, length)
    except OSError as err:
        raise _error("cachestat", path or f"fd {fd}", err) from err


def file_cachestat(path: str | os.PathLike[str]) -> tuple[int, CacheStat]:
    """Size in bytes and whole-file cachestat(2) counters of ``path``.

    Raises PageCacheError when the file cannot be opened or cachestat fails
    (errno ENOSYS, EPERM or EINVAL: this kernel or sandbox has no cachestat;
    EOPNOTSUPP: not for this file system).
    """
    name = os.fspath(path)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as err:
        raise _error("cannot open", name, err) from err
    try:
        try:
            size = fd_size(fd)
        except OSError as err:
            raise _error("fstat", name, err) from err
        return size, cachestat(fd, 0, 0, path=name)
    finally:
        os.close(fd)
