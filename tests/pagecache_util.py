"""Helpers for tests that use the real page cache and mlock (shared by several test modules)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from vmcache.host.meminfo import MemInfo

GiB = 1 << 30


def vmlck(pid: int | str = "self") -> int:
    """Bytes locked by process ``pid`` (VmLck of /proc/PID/status); 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmLck:"):
                    return int(line.split()[1]) * 1024
    except FileNotFoundError:
        return 0
    raise AssertionError(f"no VmLck line for {pid}")


def locked_pages(pid: int | str = "self") -> int:
    """Bytes of process ``pid``'s mapped pages that are locked (``Locked`` of /proc/PID/smaps); 0 when it is gone.

    Unlike VmLck, which counts whole locked mappings, this counts the pages in them: a mapping locked on
    fault (``fill: cached``) holds only the pages mapped in.
    """
    try:
        with open(f"/proc/{pid}/smaps") as f:
            return sum(int(line.split()[1]) for line in f if line.startswith("Locked:")) * 1024
    except FileNotFoundError:
        return 0


def fake_meminfo(available: int, total: int = 128 * GiB) -> Callable[[], MemInfo]:
    """A meminfo reader that always reports ``available`` bytes available."""

    def read() -> MemInfo:
        return MemInfo(total_bytes=total, free_bytes=available, available_bytes=available, cached_bytes=0,
                       dirty_bytes=0, mlocked_bytes=0, unevictable_bytes=0)

    return read


def drop(path: Path | str) -> None:
    """Ask the kernel to drop ``path``'s clean, unlocked pages from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def random_image(path: Path, size: int) -> Path:
    """``path`` filled with ``size`` random bytes, on disk (synced) and out of the page cache."""
    with open(path, "wb") as f:
        f.write(os.urandom(size))
        f.flush()
        os.fsync(f.fileno())
    drop(path)
    return path
