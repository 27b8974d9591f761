"""Which agent manages a file shared by several domains: a flock'd file per image under the runtime dir.

A base image under several domains' overlays is one file, one page cache:
it must be scanned and pinned by one agent only. Each agent that finds the
file in a disk's chain tries :meth:`LayerLock.take`; the one that gets the
lock manages the file and writes its domain name into the lock file, the
others read that name (:func:`holder`) and try again later. The kernel
releases the lock when its holder exits, however it exits.

Lock files are named by the image's ``(st_dev, st_ino)``: every path of one
file gives one lock. The holder unlinks its file before closing it; an
agent that locked a file unlinked under it sees another inode at the path
and tries again, so two agents never both hold a lock.
"""

from __future__ import annotations

import os

from ..errors import PageCacheError
from .files import try_lock

__all__ = ["LayerLock", "lock_key", "holder", "sweep"]


def lock_key(path: str) -> str:
    """The lock name of the file at ``path``. Raises PageCacheError when it cannot be stat'ed."""
    try:
        st = os.stat(path)
    except OSError as err:
        raise PageCacheError(f"cannot stat image: {os.strerror(err.errno or 0)}", path=path, errno=err.errno) from err
    return f"{st.st_dev}-{st.st_ino}"


def holder(directory: str, key: str) -> str | None:
    """The domain named in lock ``key`` (who holds it, or held it last); None when there is none."""
    try:
        with open(os.path.join(directory, key + ".lock"), encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None


def sweep(directory: str) -> int:
    """Remove the lock files nobody holds (left by a holder killed before it could); how many.

    Safe beside agents taking locks: a file is removed only while locked here,
    and a taker that locked it meanwhile sees another inode at the path.
    """
    try:
        names = [n for n in os.listdir(directory) if n.endswith(".lock")]
    except OSError:
        return 0
    removed = 0
    for name in names:
        try:
            lock = LayerLock.take(directory, name.removesuffix(".lock"), "")
        except OSError:
            continue
        if lock is not None:
            lock.release()
            removed += 1
    return removed


class LayerLock:
    """One held lock; :meth:`release` (or the process's exit) gives it up."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self._fd = fd

    @classmethod
    def take(cls, directory: str, key: str, domain: str) -> LayerLock | None:
        """Lock ``key`` for ``domain`` without waiting; None when another agent holds it.

        Raises OSError when the directory or file cannot be made.
        """
        os.makedirs(directory, mode=0o700, exist_ok=True)
        path = os.path.join(directory, key + ".lock")
        fd, _ = try_lock(path, domain.encode() + b"\n", mode=0o600)
        return None if fd is None else cls(path, fd)

    def release(self) -> None:
        """Remove the lock file and give the lock up (idempotent)."""
        if self._fd < 0:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        finally:
            os.close(self._fd)
            self._fd = -1
