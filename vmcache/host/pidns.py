"""The pid namespace an agent and its QEMU run in, as the read counter's programs tell processes apart.

``bpf_get_current_pid_tgid`` gives a thread's ids in the host's first
namespace; an agent in a container (systemd-nspawn, a pod) knows its QEMU
only by the ids of its own (libvirt's pidfile), and /proc there shows no
other. So the programs know a QEMU by its tgid in its own namespace and
that namespace's inode (:meth:`PidNs.qemu_key`). For the host's first
namespace that tgid is the one ``bpf_get_current_pid_tgid`` gives, unique
on the host: the programs look it up first, with no further cost. For the
others, ``bpf_get_ns_current_pid_tgid`` (Linux 5.7) answers only for the
namespace the thread lives in, so the programs ask it of each namespace in
the ``pidns`` table: one array entry of up to :data:`SLOTS` (nsfs device,
inode) pairs, filled from the front, which the agents of each such
namespace keep (:meth:`PidNs.claim`, :meth:`PidNs.release`).

Agents of one namespace share /run/lock and change the table under the
read counter's lock; agents of two containers share no lock, so an agent
writes the table, reads it back, and checks it again every cycle: two that
rewrote it at the same moment sort it out by the next cycle, the reads of
one cycle at most uncounted.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Protocol

__all__ = ["SLOTS", "TABLE", "INIT_INO", "PidNs", "NoSlot", "kernel_dev"]

SLOTS = 16
INIT_INO = 0xEFFFFFFC  # PROC_PID_INIT_INO: the host's first pid namespace
_PAIR = struct.Struct("=QQ")  # nsfs device (the kernel's dev_t), inode
TABLE = SLOTS * _PAIR.size  # the table's bytes: pairs from the front, then zeros
_KEY = struct.pack("=I", 0)


class Table(Protocol):
    """The ``pidns`` array map (a :class:`vmcache.host.bpf.Map`)."""

    def lookup(self, key: bytes) -> bytes | None: ...

    def update(self, key: bytes, value: bytes) -> None: ...


class Keys(Protocol):
    """The ``qemus`` hash map (a :class:`vmcache.host.bpf.Map`)."""

    def keys(self) -> list[bytes]: ...


class NoSlot(Exception):
    """The table holds :data:`SLOTS` other namespaces."""


def kernel_dev(st_dev: int) -> int:
    """A stat(2) device number in the kernel's ``major << 20 | minor`` (what tracepoints and helpers take)."""
    return (os.major(st_dev) << 20) | os.minor(st_dev)


def _read(table: Table) -> list[tuple[int, int]]:
    raw = table.lookup(_KEY) or bytes(TABLE)
    pairs = [_PAIR.unpack_from(raw, i * _PAIR.size) for i in range(SLOTS)]
    return [p for p in pairs if p[1]]


def _write(table: Table, pairs: list[tuple[int, int]]) -> None:
    table.update(_KEY, b"".join(_PAIR.pack(*p) for p in pairs).ljust(TABLE, b"\0"))


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

    @property
    def first(self) -> bool:
        """The host's first namespace: the programs know its QEMUs without the table."""
        return self.ino == INIT_INO

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

    def claim(self, table: Table) -> None:
        """This namespace in the table (the first namespace needs none). Raises NoSlot, BpfError."""
        if self.first:
            return
        for _ in range(3):  # another container's agent may rewrite the table between our read and write
            pairs = _read(table)
            if (self.dev, self.ino) in pairs:
                return
            if len(pairs) >= SLOTS:
                raise NoSlot(f"the read counter's table holds {SLOTS} other pid namespaces")
            _write(table, [*pairs, (self.dev, self.ino)])
        if (self.dev, self.ino) not in _read(table):
            raise NoSlot("the read counter's pid namespace table keeps changing")

    def release(self, table: Table, qemus: Keys) -> None:
        """This namespace out of the table once no QEMU of it is counted. Raises BpfError."""
        if self.first or any(struct.unpack("=II", key)[1] == self.ino for key in qemus.keys()):
            return
        pairs = _read(table)
        if (self.dev, self.ino) in pairs:
            _write(table, [p for p in pairs if p != (self.dev, self.ino)])
