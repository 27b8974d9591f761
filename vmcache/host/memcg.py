"""The memory cgroups pins are charged to, and the room their limits leave (cgroup v1 and v2).

A locked page cache page is charged to the memory cgroup of whoever first
read it in: the guest's reads to its QEMU's cgroup (libvirt's machine
scope), the agent's loads to the agent's own. Locked, it can no longer be
reclaimed, so under a limit - libvirt's ``<memtune><hard_limit>``, Nova's
``quota:memory_hard_limit``, a parent slice's ``MemoryMax=`` - every pinned
byte is a byte QEMU's own memory cannot grow into. When QEMU's memory grows
into a limit that pins fill, the kernel's cgroup OOM killer kills QEMU:
seen on this host with two VMs under one limited parent, QEMU's memory
grown by 130 MB of huge pages while 224 MiB were pinned (docs/reliability.md).

:class:`MemcgRoom` finds, for a set of processes (QEMU and the agent), every
ancestor cgroup with a limit, and :meth:`MemcgRoom.room` returns the bytes
the tightest of them can still take: its limit, less its usage, plus the file
pages it could reclaim, less a margin kept free for the processes' own
growth (:func:`margin`). The pinner treats that room as it treats the host's
free memory above the floor: nothing new is pinned past it, and pins are
released while it is negative. Paths are arguments, so tests pass a tree
of their own.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..errors import HostError
from .meminfo import read_meminfo

__all__ = ["CgroupLimit", "MemcgRoom", "margin", "limits_of", "memory_cgroup"]

V1_ROOT = "/sys/fs/cgroup/memory"
V2_ROOT = "/sys/fs/cgroup"
UNLIMITED_V1 = 1 << 62
"""Any v1 ``memory.limit_in_bytes`` at or above this is "no limit" (the kernel's is PAGE_COUNTER_MAX pages)."""

MARGIN_MIN = 64 << 20
MARGIN_SHARE = 8


def margin(limit: int) -> int:
    """Bytes of a limited cgroup kept free of pins: an eighth of its limit, at least 64 MiB.

    QEMU's memory grows in steps a 10 s cycle cannot follow (huge pages as
    the guest touches its RAM, block jobs' buffers); what is left of the
    margin is reclaimable page cache the kernel takes first.
    """
    return max(MARGIN_MIN, limit // MARGIN_SHARE)


@dataclass(frozen=True)
class CgroupLimit:
    """One limited memory cgroup: its path under the hierarchy's root and its figures, in bytes."""

    path: str
    limit: int
    usage: int
    reclaimable: int   # file pages on the LRU lists that nothing maps (see _reclaimable)
    file_bytes: int = 0    # page cache on its LRU lists (pins included until reclaim moves them)
    refaulted: int = 0     # file pages read back soon after their eviction, ever (workingset_refault_file)

    @property
    def room(self) -> int:
        """What it can still take before the margin: negative when it is already in it."""
        return self.limit - self.usage + self.reclaimable - margin(self.limit)


def memory_cgroup(pid: int, *, proc: str = "/proc") -> tuple[int, str] | None:
    """``(version, path)`` of ``pid``'s memory cgroup: 1 where the memory controller is on v1, else 2; None if gone."""
    try:
        with open(os.path.join(proc, str(pid), "cgroup"), encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    unified = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return 1, path
        if controllers == "":
            unified = path
    return None if unified is None else (2, unified)


def limits_of(version: int, path: str, *, v1_root: str = V1_ROOT, v2_root: str = V2_ROOT) -> list[CgroupLimit]:
    """Every cgroup from ``path`` up to (not including) the root that has a memory limit; unreadable ones skipped."""
    root = v1_root if version == 1 else v2_root
    out = []
    parts = [p for p in path.split("/") if p]
    while parts:
        here = "/" + "/".join(parts)
        found = _limit(os.path.join(root, *parts), here, version)
        if found is not None:
            out.append(found)
        parts.pop()
    return out


def _limit(directory: str, path: str, version: int) -> CgroupLimit | None:
    try:
        if version == 1:
            limit = int(_read(directory, "memory.limit_in_bytes"))
            if limit >= UNLIMITED_V1:
                return None
            usage = int(_read(directory, "memory.usage_in_bytes"))
            stat = _stat(_read(directory, "memory.stat"))
            lru = stat.get("total_inactive_file", 0) + stat.get("total_active_file", 0)
            files = _reclaimable(lru, stat.get("total_mapped_file", 0), stat.get("total_unevictable", 0))
            refaulted = stat.get("total_workingset_refault_file", stat.get("total_workingset_refault", 0))
        else:
            text = _read(directory, "memory.max").strip()
            if text == "max":
                return None
            limit = int(text)
            usage = int(_read(directory, "memory.current"))
            stat = _stat(_read(directory, "memory.stat"))
            lru = stat.get("inactive_file", 0) + stat.get("active_file", 0)
            files = _reclaimable(lru, stat.get("file_mapped", 0), stat.get("unevictable", 0))
            refaulted = stat.get("workingset_refault_file", stat.get("workingset_refault", 0))
    except (OSError, ValueError):
        return None
    return CgroupLimit(path, limit, usage, files, lru, refaulted)


def _reclaimable(lru: int, mapped: int, unevictable: int) -> int:
    """File pages the kernel could reclaim: those on the file LRU lists, less the mapped ones among them.

    A page mlock locks stays on its LRU list until reclaim next meets it
    (then it moves to the unevictable list), so the file lists count the
    pins as reclaimable until the cgroup is already short. The pins are
    mapped (the agent maps what it locks): mapped pages not yet on the
    unevictable list are left out. That leaves out the pages QEMU maps too
    (its binary, its firmware), which the kernel could take: the room is
    the smaller for it, never the larger.
    """
    return max(0, lru - max(0, mapped - unevictable))


def _read(directory: str, name: str) -> str:
    with open(os.path.join(directory, name), encoding="ascii") as f:
        return f.read()


def _host_file(directory: str, name: str) -> str:
    try:
        return _read(directory, name)
    except OSError as err:
        raise HostError(f"cannot read {os.path.join(directory, name)}: {err.strerror}") from err


def _stat(text: str) -> dict[str, int]:
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[key] = int(value)
    return out


class MemcgRoom:
    """The room the limited cgroups of some processes leave for pins, read afresh at each call.

    ``pids``: returns the processes whose cgroups count, QEMU first, then the agent;
    a process that is gone counts for nothing.
    """

    def __init__(self, pids: Callable[[], Iterable[int | None]], *, proc: str = "/proc", v1_root: str = V1_ROOT,
                 v2_root: str = V2_ROOT) -> None:
        self._pids = pids
        self._proc, self._v1, self._v2 = proc, v1_root, v2_root

    def _limits(self, pids: Iterable[int | None]) -> dict[str, CgroupLimit]:
        """Every limited cgroup above the processes ``pids``, by path (a process that is gone: none)."""
        seen: dict[str, CgroupLimit] = {}
        for pid in pids:
            where = None if pid is None else memory_cgroup(pid, proc=self._proc)
            if where is None:
                continue
            for limit in limits_of(*where, v1_root=self._v1, v2_root=self._v2):
                seen[limit.path] = limit
        return seen

    def tightest(self, *, apart: bool = False) -> CgroupLimit | None:
        """The limited cgroup with the least room, None where none is limited; ``apart``: the agent's only."""
        pids = list(self._pids())
        return self._tightest(pids[1:] if apart else pids)

    def _tightest(self, pids: Iterable[int | None]) -> CgroupLimit | None:
        return min(self._limits(pids).values(), key=lambda c: c.room, default=None)

    def apart(self) -> bool:
        """Whether the first process (QEMU) is under a limit the others (the agent) are not.

        Then a page the guest read in is charged against a limit an operator
        may lower (``virsh memtune --hard-limit``), and locked it cannot be
        reclaimed to meet it: cgroup v1 refuses the lower limit (EBUSY), v2
        OOM-kills QEMU. A page the agent reads in is charged to the agent.
        """
        pids = list(self._pids())
        return bool(self._limits(pids[:1]).keys() - self._limits(pids[1:]).keys())

    def pressure(self) -> tuple[int, int]:
        """The page cache QEMU's pins press on: file pages refaulted there ever, and its page cache in bytes -
        QEMU's tightest limited cgroup's, or the host's (/proc/vmstat, /proc/meminfo) where none is limited.
        Raises HostError when the host's figures cannot be read."""
        tight = self._tightest(list(self._pids())[:1])
        if tight is not None:
            return tight.refaulted, tight.file_bytes
        vmstat = _stat(_host_file(self._proc, "vmstat")).get
        info = read_meminfo(os.path.join(self._proc, "meminfo")).fields
        files = info.get("Active(file)", 0) + info.get("Inactive(file)", 0)
        return vmstat("workingset_refault_file", vmstat("workingset_refault", 0)), files

    def room(self, *, apart: bool = False) -> int | None:
        """Bytes pins may still take in the tightest limited cgroup (negative: release that many); None: no limit.

        ``apart``: every pin is charged to the agent (:meth:`apart`, the
        pinner's recharge): QEMU's limits are not theirs to hold to.
        """
        tight = self.tightest(apart=apart)
        return None if tight is None else tight.room
