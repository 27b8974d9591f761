"""Files vmcache writes: one atomic writer, one lock file taker and one reader of its holder, one waiting
lock for the files agents share, one name for a domain (or path) as a file name, one short name.

Cheap to import (os and re only): the libvirt hook uses it on its fast path.
"""

from __future__ import annotations

import fcntl
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import HostError

__all__ = ["exclusive", "file_stem", "lock_holder", "names_fd", "nbd_dir", "pid_in", "short_name", "try_lock",
           "write_atomic"]

_SAFE = re.compile(r"[A-Za-z0-9_.+-]")
_MAX_STEM = 200


def file_stem(name: str) -> str:
    """A file name for ``name``: a domain name (libvirt allows any character but '/') or a path.

    Letters, digits and ``_.+-`` are kept; other bytes become ``%XX``, as
    does a leading dot, so distinct names give distinct stems and none is
    ``.``, ``..`` or holds a ``/``; very long names are cut and end in a hash.
    """
    out = []
    for i, ch in enumerate(name):
        if _SAFE.match(ch) and not (i == 0 and ch == "."):
            out.append(ch)
        else:
            out.extend(f"%{b:02X}" for b in ch.encode("utf-8", "surrogatepass"))
    stem = "".join(out) or "%00"
    if len(stem) > _MAX_STEM:
        stem = f"{stem[:_MAX_STEM - 17]}~{short_name(name, 16)}"
    return stem


def short_name(text: str, digits: int = 8) -> str:
    """``digits`` hex digits of ``text``'s SHA-256: a name of fixed length, for where there is little room.

    A unix socket path has 108 bytes and a QEMU node name 31 characters, so
    the NBD socket directory of a domain and the tracker's node and socket
    names are short hashes rather than :func:`file_stem`.
    """
    import hashlib

    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:digits]


def nbd_dir(runtime_dir: str, domain: str) -> str:
    """The directory (0700) of ``domain``'s NBD sockets under ``runtime_dir``.

    Per domain: libvirt names nodes alike in every domain (libvirt-1-storage), and
    the tracker names its NBD socket after the node. Short: a socket path has 108 bytes.
    """
    return os.path.join(runtime_dir, "nbd", short_name(domain, 12))


def write_atomic(path: str | os.PathLike[str], payload: bytes | str, *, mode: int = 0o644, fsync: bool = True,
                 make_dirs: bool = False, what: str = "file") -> None:
    """Replace ``path`` with ``payload`` so a reader sees the old file or the new one, never a part.

    The file gets ``mode`` whatever the umask (readers such as Prometheus
    may run as another user). ``fsync``: flush the data before the rename
    (off for files that are only caches or rewritten every few seconds);
    ``make_dirs``: create missing directories (0755). The temporary file is
    created exclusively (no symlink followed) beside ``path`` and removed
    on failure. Raises HostError("cannot write WHAT: ...") on any OSError.
    """
    target = os.fspath(path)
    directory = os.path.dirname(target) or "."
    data = payload.encode("utf-8") if isinstance(payload, str) else payload
    tmp = os.path.join(directory, f".{os.path.basename(target)}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    try:
        if make_dirs:
            os.makedirs(directory, mode=0o755, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        try:
            try:
                os.fchmod(fd, mode)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                if fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, target)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
    except OSError as err:
        raise HostError(f"cannot write {what}: {err.strerror}", path=target, errno=err.errno) from err


def names_fd(path: str, fd: int) -> bool:
    """True if ``path`` still names the file open as ``fd`` (a lock file may be unlinked or replaced under us)."""
    try:
        st, here = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (here.st_dev, here.st_ino)


@contextmanager
def exclusive(path: str, what: str = "lock") -> Iterator[None]:
    """Hold the exclusive ``flock`` of ``path + ".lock"`` (made, with its directory, if absent) while inside,
    waiting for it: how agents change a file they share (the ledger, the warm-up budget). Raises HostError."""
    try:
        os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
        fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError as err:
        raise HostError(f"cannot open {what} lock: {err.strerror}", path=path, errno=err.errno) from err
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the flock


def try_lock(path: str, owner: bytes, *, mode: int = 0o644) -> tuple[int | None, bytes]:
    """Take the exclusive ``flock`` of lock file ``path`` (made if absent) without waiting.

    Taken: ``(fd, b"")``, with ``owner`` written into the file (the lock
    lives as long as the fd, and ends with the process). Held by another:
    ``(None, what its owner wrote)``. A file its last holder unlinked
    between our open and flock is not a lock any more: opened again. The
    holder removes the file before closing the fd, so a name is never
    shared by two holders. Raises OSError when the file cannot be made.
    """
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, mode)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                return None, os.pread(fd, 256, 0)
            finally:
                os.close(fd)
        except OSError:
            os.close(fd)
            raise
        if names_fd(path, fd):
            os.ftruncate(fd, 0)
            os.pwrite(fd, owner, 0)
            return fd, b""
        os.close(fd)


def pid_in(raw: bytes) -> int | None:
    """The pid a lock file (pidfile) holds (None: empty or not a number)."""
    try:
        text = raw.decode("ascii").strip()
        return int(text) if text else None
    except (ValueError, UnicodeDecodeError):
        return None


def lock_holder(path: str) -> int | None:
    """If a process holds the flock on lock file ``path`` (a pidfile, a run lock): the pid it wrote there
    (0: none written yet).

    None when no process holds it (none runs, or the file is stale or absent). Raises HostError.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise HostError(f"cannot open lock file: {err.strerror}", path=path, errno=err.errno) from err
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            return pid_in(os.pread(fd, 32, 0)) or 0
        except OSError:
            return 0
    except OSError as err:
        raise HostError(f"cannot lock {path}: {err.strerror}", path=path, errno=err.errno) from err
    finally:
        os.close(fd)  # also drops our shared lock, if we got it
    return None
