"""A delay device for the end-to-end bench: a FUSE passthrough of one directory whose reads cost a set time.

    .venv/bin/python bench/delaydev.py BACKING MOUNTPOINT --read-ms 0.4 [--write-ms 0] [--fsync-ms MS]
        [--stats FILE] [--log-reads FILE]

Every file directly in BACKING appears under MOUNTPOINT. The kernel's page
cache sits *above* the delay: files open with ``keep_cache`` (no
``direct_io``), so a read the page cache holds never reaches this daemon,
and what is cached survives closes and reopens; eviction (fadvise
DONTNEED, vmtouch -e), mincore, cachestat, mmap + mlock and memory-cgroup
charging work as on any file, charged to whoever faulted the page in. Only
misses (the kernel's read and readahead requests) come here: each one
sleeps ``--read-ms`` in its own thread, then preads the backing file, so
requests in flight overlap like a device with a queue. Writes go through
(FUSE without writeback cache) and may cost ``--write-ms`` each; an fsync
is a real fdatasync of the backing file, or, with ``--fsync-ms``, costs that
time and no more: a flush then costs the same every hour, not what this
machine's own disk takes for it (the data still reaches the backing file's
page cache at once, so every mount of it reads what was written).

The backing file is read buffered: its own page cache (charged to this
daemon's cgroup, not the bench's) makes a miss cost the delay and not the
real disk's variable latency as well.

Attributes are frozen at lookup (size and times change only through this
mount): a changed mtime seen by the kernel would make it drop the whole
file's page cache (FUSE's auto_inval_data).

The kernel lets only ``max_background`` asynchronous requests (readahead)
be in flight per mount, 12 by default: raised to ``--queue-depth`` so a
QD32 guest gets 32 requests served at once.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyfuse3
import trio

PR_SET_TIMERSLACK = 29
TIMEOUT = 3600.0   # attributes and names never change behind the kernel's back


class DelayFS(pyfuse3.Operations):
    def __init__(self, backing: Path, read_s: float, write_s: float, read_log=None, fsync_s: float | None = None):
        super().__init__()
        self.fsync_s = fsync_s     # None: a real fdatasync
        self.read_log = read_log   # a text file: one line per read served, "unix_time file offset bytes"
        self.backing = backing
        self.read_s, self.write_s = read_s, write_s
        self.inodes: dict[bytes, int] = {}
        self.names: dict[int, bytes] = {}
        self.attrs: dict[int, pyfuse3.EntryAttributes] = {}
        self.fds: dict[int, int] = {}
        self.stats = {"reads": 0, "read_bytes": 0, "writes": 0, "write_bytes": 0, "fsyncs": 0, "getattrs": 0,
                      "in_flight_max": 0}
        self._in_flight = 0
        self._lock = threading.Lock()

    # ------------------------------------------------------------ names and attributes

    def _path(self, inode: int) -> Path:
        return self.backing / os.fsdecode(self.names[inode])

    def _entry(self, inode: int, st: os.stat_result) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        for key in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_rdev", "st_size", "st_blksize", "st_blocks",
                    "st_atime_ns", "st_mtime_ns", "st_ctime_ns"):
            setattr(e, key, getattr(st, key))
        e.st_ino = inode
        e.generation = 0
        e.entry_timeout = e.attr_timeout = TIMEOUT
        return e

    async def lookup(self, parent_inode, name, ctx=None):
        if parent_inode != pyfuse3.ROOT_INODE or name in (b".", b"..") or b"/" in name:
            if name in (b".", b"..") and parent_inode == pyfuse3.ROOT_INODE:
                return await self.getattr(pyfuse3.ROOT_INODE)
            raise pyfuse3.FUSEError(errno.ENOENT)
        try:
            st = os.lstat(self.backing / os.fsdecode(name))
        except OSError as err:
            raise pyfuse3.FUSEError(err.errno) from None
        if not stat.S_ISREG(st.st_mode):
            raise pyfuse3.FUSEError(errno.ENOENT)
        inode = self.inodes.get(name)
        if inode is None:
            inode = self.inodes[name] = len(self.inodes) + pyfuse3.ROOT_INODE + 1
            self.names[inode] = name
            self.attrs[inode] = self._entry(inode, st)
        return self.attrs[inode]

    async def getattr(self, inode, ctx=None):
        self.stats["getattrs"] += 1
        if inode == pyfuse3.ROOT_INODE:
            return self._entry(inode, os.stat(self.backing))
        return self.attrs[inode]

    async def setattr(self, inode, attr, fields, fh, ctx):
        path = self._path(inode)
        try:
            if fields.update_size:
                os.truncate(path, attr.st_size)
            if fields.update_mode:
                os.chmod(path, stat.S_IMODE(attr.st_mode))
            if fields.update_uid or fields.update_gid:
                os.chown(path, attr.st_uid if fields.update_uid else -1, attr.st_gid if fields.update_gid else -1)
            if fields.update_atime or fields.update_mtime:
                st = os.stat(path)
                os.utime(path, ns=(attr.st_atime_ns if fields.update_atime else st.st_atime_ns,
                                   attr.st_mtime_ns if fields.update_mtime else st.st_mtime_ns))
            self.attrs[inode] = self._entry(inode, os.stat(path))
        except OSError as err:
            raise pyfuse3.FUSEError(err.errno) from None
        return self.attrs[inode]

    async def statfs(self, ctx):
        st = os.statvfs(self.backing)
        out = pyfuse3.StatvfsData()
        for key in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree", "f_favail",
                    "f_namemax"):
            setattr(out, key, getattr(st, key))
        return out

    async def opendir(self, inode, ctx):
        if inode != pyfuse3.ROOT_INODE:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    async def readdir(self, fh, start_id, token):
        names = sorted(os.fsencode(e.name) for e in os.scandir(self.backing) if e.is_file(follow_symlinks=False))
        for i, name in enumerate(names[start_id:], start_id + 1):
            attr = await self.lookup(pyfuse3.ROOT_INODE, name)
            if not pyfuse3.readdir_reply(token, name, attr, i):
                break

    async def releasedir(self, fh):
        pass

    # ------------------------------------------------------------ extended attributes (vmcache's image id, libvirt's labels)

    async def getxattr(self, inode, name, ctx):
        try:
            return os.getxattr(self._path(inode), os.fsdecode(name))
        except OSError as err:
            raise pyfuse3.FUSEError(err.errno) from None

    async def setxattr(self, inode, name, value, ctx):
        try:
            os.setxattr(self._path(inode), os.fsdecode(name), value)
        except OSError as err:
            raise pyfuse3.FUSEError(err.errno) from None

    async def listxattr(self, inode, ctx):
        try:
            return [os.fsencode(n) for n in os.listxattr(self._path(inode))]
        except OSError as err:
            raise pyfuse3.FUSEError(err.errno) from None

    async def removexattr(self, inode, name, ctx):
        try:
            os.removexattr(self._path(inode), os.fsdecode(name))
        except OSError as err:
            raise pyfuse3.FUSEError(err.errno) from None

    # ------------------------------------------------------------ data

    async def open(self, inode, flags, ctx):
        keep = os.O_ACCMODE | os.O_APPEND
        try:
            fd = os.open(self._path(inode), (flags & keep) | os.O_CLOEXEC)
        except OSError as err:
            raise pyfuse3.FUSEError(err.errno) from None
        self.fds[fd] = inode
        info = pyfuse3.FileInfo(fh=fd)
        info.keep_cache = True     # what the page cache holds survives this open
        info.direct_io = False
        return info

    def _slow(self, delay: float, op, *args):
        """In a worker thread: wait ``delay`` (each request its own), then do the I/O."""
        with self._lock:
            self._in_flight += 1
            self.stats["in_flight_max"] = max(self.stats["in_flight_max"], self._in_flight)
        try:
            if delay > 0:
                time.sleep(delay)
            return op(*args)
        finally:
            with self._lock:
                self._in_flight -= 1

    async def read(self, fh, off, size):
        try:
            data = await trio.to_thread.run_sync(self._slow, self.read_s, os.pread, fh, size, off)
        except OSError as err:
            raise pyfuse3.FUSEError(err.errno) from None
        self.stats["reads"] += 1
        self.stats["read_bytes"] += len(data)
        if self.read_log is not None:
            name = os.fsdecode(self.names.get(self.fds.get(fh, 0), b"?"))
            self.read_log.write(f"{time.time():.3f} {name} {off} {len(data)}\n")
        return data

    async def write(self, fh, off, buf):
        try:
            if self.write_s > 0:
                n = await trio.to_thread.run_sync(self._slow, self.write_s, os.pwrite, fh, buf, off)
            else:
                n = os.pwrite(fh, buf, off)
        except OSError as err:
            raise pyfuse3.FUSEError(err.errno) from None
        self.stats["writes"] += 1
        self.stats["write_bytes"] += n
        return n

    async def fsync(self, fh, datasync):
        try:
            if self.fsync_s is not None:
                await trio.sleep(self.fsync_s)   # the other requests go on meanwhile, as on a device's queue
            else:
                await trio.to_thread.run_sync(os.fdatasync, fh)
        except OSError as err:
            raise pyfuse3.FUSEError(err.errno) from None
        self.stats["fsyncs"] += 1

    async def flush(self, fh):
        pass

    async def release(self, fh):
        self.fds.pop(fh, None)
        os.close(fh)


def set_queue_depth(mountpoint: Path, depth: int) -> None:
    """Let ``depth`` asynchronous requests be in flight on this mount (the kernel's default is 12)."""
    conns = Path("/sys/fs/fuse/connections")
    if not os.path.ismount(conns):
        subprocess.run(["mount", "-t", "fusectl", "fusectl", str(conns)], check=True)
    conn = conns / str(os.minor(os.stat(mountpoint).st_dev))
    (conn / "max_background").write_text(f"{depth}\n")
    (conn / "congestion_threshold").write_text(f"{max(1, depth * 3 // 4)}\n")


async def serve(fs: DelayFS, mountpoint: Path, depth: int, stats: Path | None) -> None:
    async def write_stats() -> None:
        while True:
            if stats is not None:
                tmp = stats.with_suffix(".tmp")
                tmp.write_text(json.dumps(fs.stats))
                tmp.replace(stats)
            if fs.read_log is not None:
                fs.read_log.flush()   # a reader of the log sees what was served up to half a second ago
            await trio.sleep(0.5)

    async def fuse_main() -> None:
        await pyfuse3.main()           # returns once the file system is unmounted, by anyone
        nursery.cancel_scope.cancel()  # then nothing is left to serve: the daemon ends

    trio.to_thread.current_default_thread_limiter().total_tokens = depth
    async with trio.open_nursery() as nursery:
        nursery.start_soon(fuse_main)
        # stat() of the mount needs the loop above to answer the kernel: from a thread
        await trio.to_thread.run_sync(set_queue_depth, mountpoint, depth)
        nursery.start_soon(write_stats)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                nursery.cancel_scope.cancel()
                break


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("backing", type=Path)
    p.add_argument("mountpoint", type=Path)
    p.add_argument("--read-ms", type=float, required=True, help="time each read request (a miss) costs")
    p.add_argument("--write-ms", type=float, default=0.0, help="time each write request costs (default 0)")
    p.add_argument("--fsync-ms", type=float,
                   help="time each fsync costs, instead of a real fdatasync of the backing file (default: real)")
    p.add_argument("--queue-depth", type=int, default=64, help="requests in flight at once (default 64)")
    p.add_argument("--stats", type=Path, help="JSON counters written here every 0.5 s")
    p.add_argument("--log-reads", type=Path,
                   help="append one line per read served to this file: unix time, file name, offset, bytes "
                        "(flushed every 0.5 s)")
    p.add_argument("--nice", type=int, default=-10, help="the daemon's nice value (default -10: ahead of the guest)")
    args = p.parse_args()
    # A device needs no host CPU: on a host whose cores the TCG guest keeps busy the daemon's
    # threads would otherwise queue for a CPU behind it, and that queueing would be the device's cost.
    os.setpriority(os.PRIO_PROCESS, 0, args.nice)
    # the kernel may wake a sleeper up to 50 us late by default; the delay is the point here
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)
    read_log = open(args.log_reads, "a", buffering=1 << 16) if args.log_reads else None  # noqa: SIM115 - closed below
    fs = DelayFS(args.backing.resolve(), args.read_ms / 1000, args.write_ms / 1000, read_log,
                 None if args.fsync_ms is None else args.fsync_ms / 1000)
    options = set(pyfuse3.default_options) | {"fsname=vmcache-delaydev", "allow_other"}
    pyfuse3.init(fs, str(args.mountpoint), options)
    try:
        trio.run(serve, fs, args.mountpoint, args.queue_depth, args.stats)
    finally:
        pyfuse3.close(unmount=True)
        if read_log is not None:
            read_log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
