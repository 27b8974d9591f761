"""Every read QEMU makes of a managed image, counted per model block in the kernel (issue 20).

One set of BPF programs for the whole host (:mod:`vmcache.host.readsets`:
the ``filemap_read`` probe where the kernel allows it, else the 6.12+
tracepoints) sees every buffered read, hit or miss, and the pages that
enter the cache for it. It counts only the reads of processes in its
``qemus`` map (each agent adds its domain's QEMU) of files in its
``meta`` map (each disk worker adds its image): the agent's own loads
and probes, and everything else on the host, pass through it untouched.

Shared, not one per agent: a tracepoint or function takes at most 64
programs (the 65th attachment fails with E2BIG), and each runs on every
buffered read on the host (docs/benchmarks.md "Counting guest reads").
The first agent loads the programs and their maps and attaches them (BPF
links); every later agent finds them by name and takes its own
descriptors of the same links and maps by id. Nothing is pinned: the program lives while an agent holds
a descriptor, and goes with the last one (stop, crash or SIGKILL).

Per image, two count maps (generation 0 and 1) hold, per touched block,
the pages read, the pages that entered the cache for those reads, and
the difference entries of reads spanning more than two blocks (decoded
here). Each cycle :meth:`FileReads.take` makes the other map current,
waits a millisecond for programs still running on the old one, and
empties it. A map that fills counts further blocks' reads as drops
(:attr:`FileReads.dropped`) until it is emptied.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import struct
import time
from collections.abc import Callable, Iterator

import numpy as np

from ..errors import HostError
from ..model.blocks import BlockValues
from ..model.reads import GuestReads
from . import bpf
from .cachekey import cache_key
from .pidns import NoSlot, PidNs
from .procs import cmdline
from .readmaps import COUNT_VALUE, INNER_ENTRIES, Maps
from .readhost import close_all, find_set, load_set, sweep
from .readsets import ORDER, ReadSet
from .runlock import RUN_LOCK_DIR

__all__ = ["ReadCountError", "ReadCounter", "FileReads", "qemu_pid", "LOCK_NAME"]

LOCK_NAME = "reads.lock"
PAGE = 4096
SETTLE_SECONDS = 0.001  # programs that read the old generation finish within microseconds (preemption off)
_log = logging.getLogger(__name__)


class ReadCountError(HostError):
    """Guest reads cannot be counted on this host (no BPF, no probe or tracepoint, not allowed); the message
    says why."""


def qemu_pid(domain: str, *, run_dir: str = "/run/libvirt/qemu", proc: str = "/proc") -> int | None:
    """The pid of the QEMU libvirt runs ``domain`` in (its pidfile, checked against the command line)."""
    try:
        with open(os.path.join(run_dir, f"{domain}.pid"), encoding="ascii") as f:
            pid = int(f.read().strip())
    except (OSError, ValueError):
        return None
    argv = cmdline(pid, proc=proc)
    if not argv or not any(f"guest={domain}" in arg.split(",") for arg in argv):
        return None
    return pid


class ReadCounter:
    """The host's read-counting programs as one agent holds them, counting the reads of QEMU ``pid``."""

    def __init__(self, maps: Maps, links: list[int], pid: int, kind: type[ReadSet], ns: PidNs, *,
                 lock_dir: str = RUN_LOCK_DIR, readset: ReadSet | None = None) -> None:
        """``pid``: QEMU's in ``ns``, this agent's pid namespace; ``kind``: the set that runs; ``lock_dir``:
        where the agents of ``ns`` share the counter's lock; ``readset``: what this kernel offers it, when
        the caller read it already (else read on first use). Raises BpfError, NoSlot."""
        self._lock_dir = lock_dir
        self._maps = maps
        self._links = links
        self.pid = pid
        self.kind = kind
        self._ns = ns
        self._readset = readset
        self._maps.qemus.update(ns.qemu_key(pid), ns.owner(os.getpid()))
        try:
            ns.claim(maps.pidns)
        except BaseException:
            self._maps.qemus.delete(ns.qemu_key(pid))
            raise

    @property
    def signal(self) -> str:
        """Which set counts: ``probe`` or ``tracepoint``."""
        return self.kind.SIGNAL

    @classmethod
    def open(cls, pid: int, *, lock_dir: str = RUN_LOCK_DIR,
             order: tuple[type[ReadSet], ...] = ORDER) -> ReadCounter:
        """Join (or load and attach) the host's programs, and count QEMU ``pid``'s reads.

        A set another agent loaded is joined, whichever it is; else the
        first of ``order`` this kernel runs is loaded. Raises
        ReadCountError when none can be: no BTF and no tracepoint, BPF
        refused (no CAP_BPF/CAP_PERFMON, BPF off), maps or programs refused.
        """
        try:
            with _locked(lock_dir):  # two agents starting at once load one set
                return cls._open(pid, lock_dir, order)
        except (bpf.BpfError, HostError) as err:
            raise ReadCountError(str(err), errno=err.errno) from err
        except (OSError, NoSlot) as err:
            raise ReadCountError(f"cannot count QEMU's reads from this pid namespace: {err}",
                                 errno=getattr(err, "errno", None)) from err

    @classmethod
    def _open(cls, pid: int, lock_dir: str, order: tuple[type[ReadSet], ...]) -> ReadCounter:
        ns = PidNs.own()
        found = find_set(order)
        readset = None
        if found is not None:
            maps, links, kind = Maps.adopt(found.maps), found.links, found.kind
        else:
            maps, links, readset = load_set(order)
            kind = type(readset)
        try:
            sweep(maps, ns)
            return cls(maps, links, pid, kind, ns, lock_dir=lock_dir, readset=readset)
        except BaseException:
            close_all(links)
            maps.close()
            raise

    def watch(self, path: str, block_size: int) -> FileReads:
        """Count QEMU's reads of the image at ``path`` in blocks of ``block_size`` bytes (a multiple of 4096).

        Raises ReadCountError (the file cannot be read, its page cache's
        identity not found, the maps refuse it).
        """
        try:
            if self._readset is None:
                self._readset = self.kind.for_kernel()
            key = cache_key(path, self._readset, self._ns)
        except (OSError, HostError, LookupError) as err:
            raise ReadCountError(f"cannot tell how the kernel names {path}: {err}", path=path,
                                 errno=getattr(err, "errno", None)) from err
        return FileReads(self._maps, path, block_size, key, self._ns, keep=self.keep)

    def keep(self) -> None:
        """Make sure the programs still ask for this agent's pid namespace (an agent of another container,
        sharing no lock with this one, may have rewritten the table at the same moment). Raises
        ReadCountError."""
        try:
            self._ns.claim(self._maps.pidns)
        except (bpf.BpfError, NoSlot) as err:
            raise ReadCountError(f"cannot keep this pid namespace counted: {err}",
                                 errno=getattr(err, "errno", None)) from err

    def close(self) -> None:
        """Stop counting this QEMU's reads, and this pid namespace's when it was the last QEMU counted of it;
        let go of the programs (the last holder's close removes them)."""
        try:
            self._maps.qemus.delete(self._ns.qemu_key(self.pid))
            with _locked(self._lock_dir):  # an agent of the namespace starting now keeps it in the table
                self._ns.release(self._maps.pidns, self._maps.qemus)
        except (bpf.BpfError, ReadCountError) as err:
            _log.debug("reads.qemu_unregister_failed error=%s", err)
        for fd in self._links:
            os.close(fd)
        self._links = []
        self._maps.close()


class FileReads:
    """One image's counts: registered at creation, :meth:`take` once per cycle, :meth:`close` at the end."""

    def __init__(self, maps: Maps, path: str, block_size: int, key: tuple[int, int], ns: PidNs, *,
                 keep: Callable[[], None] = lambda: None) -> None:
        """``key``: the (i_ino, s_dev) the tracepoints name the image by (:func:`cache_key`); ``ns``: the
        agent's pid namespace; ``keep``: called at each take, before the counts are read (raises
        ReadCountError when the reads can no longer be counted)."""
        if block_size <= 0 or block_size % PAGE:
            raise ValueError(f"block size {block_size} is not a positive multiple of {PAGE}")
        self.path = path
        self._maps = maps
        self._ns = ns
        self._keep = keep
        self._pages = block_size // PAGE
        self._file = struct.pack("=QI", *key)
        self._gen = 0
        self._counts: list[bpf.Map] = []
        self.dropped = 0
        try:
            for gen in (0, 1):
                inner = bpf.Map(bpf.HASH, 8, COUNT_VALUE, INNER_ENTRIES, name="vmc_reads_blk", flags=bpf.NO_PREALLOC)
                self._counts.append(inner)
                maps.files.update(self._file + struct.pack("=I", gen), inner.fd)
            maps.drops.update(self._file + b"\0" * 4, struct.pack("=Q", 0))
            self._set_meta()
        except bpf.BpfError as err:
            self.close()
            raise ReadCountError(f"cannot count reads of {path}: {err}", path=path, errno=err.errno) from err
        self._drops_seen = 0

    def _set_meta(self) -> None:
        self._maps.meta.update(self._file + b"\0" * 4,
                               struct.pack("=QI", self._pages, self._gen) + self._ns.owner(os.getpid()) + bytes(4))

    def take(self, nblocks: int, *, sleep: Callable[[float], None] = time.sleep) -> GuestReads:
        """The reads since the last take, per block below ``nblocks``; the counts start again from zero.

        Raises ReadCountError when the maps cannot be read (nothing is lost:
        the next take reads them).
        """
        self._keep()
        old = self._counts[self._gen]
        try:
            self._gen ^= 1
            self._set_meta()
            sleep(SETTLE_SECONDS)
            entries = list(old.drain())
            drops = self._maps.drops.lookup(self._file + b"\0" * 4)
        except bpf.BpfError as err:
            raise ReadCountError(f"cannot read the read counts of {self.path}: {err}", path=self.path,
                                 errno=err.errno) from err
        if drops is not None:
            total = struct.unpack("=Q", drops)[0]
            self.dropped, self._drops_seen = self.dropped + total - self._drops_seen, total
        return decode(entries, self._pages, nblocks)

    def close(self) -> None:
        """Stop counting this image, unless another counter of it took over since; free its maps."""
        mine = {m.ident for m in self._counts if m.fd >= 0}
        meta_key = self._file + b"\0" * 4
        try:
            ours = False
            for gen in (0, 1):
                key = self._file + struct.pack("=I", gen)
                if _inner_id(self._maps.files, key) in mine:
                    self._maps.files.delete(key)
                    ours = True
            if ours:
                self._maps.meta.delete(meta_key)
                self._maps.drops.delete(meta_key)
        except bpf.BpfError as err:
            _log.debug("reads.unregister_failed path=%s error=%s", self.path, err)
        for inner in self._counts:
            inner.close()


@contextlib.contextmanager
def _locked(lock_dir: str) -> Iterator[None]:
    """The read counter's lock of this pid namespace's agents, held. Raises ReadCountError."""
    try:
        os.makedirs(lock_dir, mode=0o755, exist_ok=True)
        lock = os.open(os.path.join(lock_dir, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as err:
        raise ReadCountError(f"cannot take the read counter's lock: {err.strerror}", path=lock_dir,
                             errno=err.errno) from err
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
    finally:
        os.close(lock)


def _inner_id(outer: bpf.Map, key: bytes) -> int | None:
    value = outer.lookup(key)
    return struct.unpack_from("=I", value)[0] if value is not None else None


def decode(entries: list[tuple[bytes, bytes]], pages_per_block: int, nblocks: int) -> GuestReads:
    """GuestReads from drained (block, counts) entries: direct counts plus the spans' difference entries."""
    if not entries:
        return GuestReads.empty()
    raw = np.frombuffer(b"".join(v for _, v in entries), dtype=np.int64).reshape(-1, 4)
    blocks = np.frombuffer(b"".join(k for k, _ in entries), dtype=np.uint64)
    order = np.argsort(blocks, kind="stable")
    blocks, raw = blocks[order].astype(np.int64), raw[order]
    return GuestReads(_column(blocks, raw[:, 0], raw[:, 1], nblocks),
                      _column(blocks, raw[:, 2], raw[:, 3], nblocks))


def _column(blocks: np.ndarray, direct: np.ndarray, diff: np.ndarray, nblocks: int) -> BlockValues:
    """Per block: its direct count plus the running sum of difference entries (spans of whole blocks)."""
    running = np.cumsum(diff)
    ends = np.append(blocks[1:], blocks[-1] + 1)
    spans = running != 0
    lengths = np.where(spans, ends - blocks, 1)
    idx = np.repeat(blocks, lengths) + _offsets(lengths)
    val = np.repeat(np.where(spans, running, 0), lengths)
    first = np.zeros(idx.size, dtype=bool)
    first[np.cumsum(lengths) - lengths] = True
    val[first] += direct
    keep = (val > 0) & (idx < nblocks)
    return BlockValues(idx[keep], val[keep].astype(np.float32))


def _offsets(lengths: np.ndarray) -> np.ndarray:
    """0, 1, ... lengths[i]-1 for each i, concatenated."""
    starts = np.cumsum(lengths) - lengths
    out: np.ndarray = np.arange(int(lengths.sum())) - np.repeat(starts, lengths)
    return out
