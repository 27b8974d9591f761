"""The pid namespace an agent and its QEMU run in, as the read counter's programs tell processes apart.

``bpf_get_current_pid_tgid`` gives a thread's ids in the host's first
namespace; an agent in a container (systemd-nspawn, a pod) knows its QEMU
only by the ids of its own (libvirt's pidfile), and /proc there shows no
other. So the programs know a QEMU by its tgid in its own namespace and
that namespace's inode, and find a thread's with
``bpf_get_ns_current_pid_tgid`` (Linux 5.7), which answers only for the
namespace the thread lives in: the ``pidns`` array holds up to
:data:`SLOTS` namespaces (nsfs device, inode), each filled by the agents
of that namespace, and the programs ask each filled slot in turn. An agent
on the host itself registers the first namespace like any other.

Agents of one namespace share /run/lock and change the slots under the
read counter's lock; agents of two containers share no lock, so a slot is
written, read back, and checked again every cycle (:meth:`PidNs.claim`):
two agents that took one free slot at the same moment sort it out by the
next cycle, the reads of one cycle at most uncounted.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Protocol

__all__ = ["SLOTS", "INIT_INO", "PidNs", "NoSlot", "kernel_dev"]

SLOTS = 16
INIT_INO = 0xEFFFFFFC  # PROC_PID_INIT_INO: the host's first pid namespace
_SLOT = struct.Struct("=QQ")  # nsfs device (the kernel's dev_t), inode; 0, 0 when free


class Slots(Protocol):
    """The ``pidns`` array map (a :class:`vmcache.host.bpf.Map`)."""

    def lookup(self, key: bytes) -> bytes | None: ...

    def update(self, key: bytes, value: bytes) -> None: ...


class Keys(Protocol):
    """The ``qemus`` hash map (a :class:`vmcache.host.bpf.Map`)."""

    def keys(self) -> list[bytes]: ...


class NoSlot(Exception):
    """Every slot holds another namespace."""


def kernel_dev(st_dev: int) -> int:
    """A stat(2) device number in the kernel's ``major << 20 | minor`` (what tracepoints and helpers take)."""
    return (os.major(st_dev) << 20) | os.minor(st_dev)


@dataclass(frozen=True)
class PidNs:
    """A pid namespace by its nsfs device and inode."""

    dev: int
    ino: int

    @classmethod
    def own(cls, proc: str = "/proc") -> PidNs:
        """This process's namespace. Raises OSError."""
        st = os.stat(os.path.join(proc, "self/ns/pid"))
        return cls(kernel_dev(st.st_dev), st.st_ino)

    def qemu_key(self, tgid: int) -> bytes:
        """The ``qemus`` key of the process ``tgid`` of this namespace."""
        return struct.pack("=II", tgid, self.ino)

    def owner(self, pid: int) -> bytes:
        """The value that names agent ``pid`` of this namespace as an entry's owner."""
        return struct.pack("=II", pid, self.ino)

    def owns(self, value: bytes, offset: int = 0) -> int | None:
        """The pid of the agent of this namespace that owns an entry (its owner at ``offset``), else None."""
        pid, ino = struct.unpack_from("=II", value, offset)
        return pid if ino == self.ino else None

    def claim(self, slots: Slots) -> int:
        """The slot that holds this namespace, written into a free one if none does. Raises NoSlot, BpfError."""
        mine = _SLOT.pack(self.dev, self.ino)
        held = [slots.lookup(struct.pack("=I", i)) for i in range(SLOTS)]
        if mine in held:
            return held.index(mine)
        for i, value in enumerate(held):
            if value is None or _SLOT.unpack(value)[1] == 0:
                key = struct.pack("=I", i)
                slots.update(key, mine)
                if slots.lookup(key) == mine:
                    return i
        raise NoSlot(f"all {SLOTS} pid namespace slots of the read counter are taken")

    def release(self, slots: Slots, qemus: Keys) -> None:
        """Free this namespace's slot when no QEMU of it is counted any more. Raises BpfError."""
        if any(struct.unpack("=II", key)[1] == self.ino for key in qemus.keys()):
            return
        mine = _SLOT.pack(self.dev, self.ino)
        for i in range(SLOTS):
            key = struct.pack("=I", i)
            if slots.lookup(key) == mine:
                slots.update(key, _SLOT.pack(0, 0))
