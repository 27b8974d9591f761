"""The (inode, device) by which the kernel's page-cache tracepoints name an image.

The read-counting programs (:mod:`vmcache.host.readprog`) know an image
by the ``i_ino`` and ``s_dev`` the tracepoints record: the inode that owns
the page cache and its superblock's device. stat(2) does not always say
the same: a block device's cache belongs to the kernel's bdev inode (on
Linux 6.18, device ``0:3`` and inode number the device number), not to the
``/dev`` node a domain names; btrfs reports a subvolume's device, not the
superblock's; overlayfs reports its own inode, not the real one whose cache
is read. So the key is asked of the kernel: a small program on
``mm_filemap_get_pages`` records the event of one read of the image by
this thread, and goes at once.
"""

from __future__ import annotations

import os
import stat
import struct
import threading

from . import bpf, bpfasm
from .pidns import PidNs, kernel_dev
from .readprog import KeyLoader
from .readsets import ReadSet

__all__ = ["cache_key", "probe_program"]

PROBE_NAME = "vmcache_key"
# stack: the array map's key; the record copied (ino u64, dev u32, seen u32); bpf_pidns_info (pid, tgid)
_KEY, _SEEN, _NSINFO = -4, -24, -32


def probe_program(key: KeyLoader, ns: PidNs, tgid: int, tid: int, out: bpf.Map) -> bytes:
    """A program that writes the (i_ino, s_dev) ``key`` reads from its context, for the reads of thread
    ``tid`` of process ``tgid`` (their ids in ``ns``) only, into slot 0 of the array map ``out``, with a
    seen flag."""
    a = bpfasm.Asm()
    a.mov(6, ("r", 1))
    a.load_imm64(1, ns.dev)
    a.load_imm64(2, ns.ino)
    a.mov(3, ("r", 10))
    a.alu("add", 3, _NSINFO)
    a.mov(4, 8)
    a.call(bpfasm.NS_PID_TGID)
    a.jump("ne", 0, 0, "out")
    a.load(1, 10, _NSINFO, 4)
    a.jump("ne", 1, tid, "out")
    a.load(1, 10, _NSINFO + 4, 4)
    a.jump("ne", 1, tgid, "out")
    key(a, _SEEN)
    a.store_imm(10, _SEEN + 12, 1, 4)
    a.store_imm(10, _KEY, 0, 4)
    a.map_fd(1, out)
    a.mov(2, ("r", 10))
    a.alu("add", 2, _KEY)
    a.call(bpfasm.LOOKUP)
    a.jump("eq", 0, 0, "out")
    for off in (0, 8):
        a.load(1, 10, _SEEN + off, 8)
        a.store(0, off, 1, 8)
    a.label("out")
    a.mov(0, 0)
    a.exit()
    return a.assemble()


def cache_key(path: str, readset: ReadSet, ns: PidNs) -> tuple[int, int]:
    """The (i_ino, s_dev) the counting programs of ``readset`` give the file or block device at ``path``,
    read by this thread of the pid namespace ``ns`` (this process's).

    Found by reading its first page twice (the second read is a cache hit,
    which always fires ``mm_filemap_get_pages``) while the probe program watches this
    thread; without readahead (POSIX_FADV_RANDOM), so one page at most
    enters the cache. A regular file the probe sees no read of (empty)
    keeps stat(2)'s identity. Raises OSError (the image cannot be read),
    BpfError (the probe cannot be loaded or attached), LookupError (no read
    of a block device was seen).
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        out = bpf.Map(bpf.ARRAY, 4, 16, 1, name="vmc_key")
        try:
            code = probe_program(readset.key, ns, os.getpid(), threading.get_native_id(), out)
            link = readset.attach_probe(code, PROBE_NAME)
            try:
                os.pread(fd, 4096, 0)
                os.pread(fd, 4096, 0)
            finally:
                os.close(link)
            ino, dev, seen = struct.unpack("=QII", out.lookup(b"\0" * 4) or bytes(16))
        finally:
            out.close()
    finally:
        os.close(fd)
    if seen:
        return ino, dev
    if stat.S_ISBLK(st.st_mode):
        raise LookupError(f"no read of {path} seen by the {readset.SIGNAL}")
    return st.st_ino, kernel_dev(st.st_dev)
