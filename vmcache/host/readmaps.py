"""The read counter's BPF maps (:mod:`vmcache.host.readprog` writes the programs over them).

Both program sets fill the same maps; agents find a loaded set's maps by
their names (``vmc_...``) and adopt them with these sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

from . import bpf
from .pidns import TABLE

__all__ = ["COUNT_VALUE", "INNER_ENTRIES", "Maps"]

COUNT_VALUE = 32  # pages, pages' span difference, missed, missed's span difference (u64 each)
INNER_ENTRIES = 65536  # blocks of one image one count map holds: touched blocks of one cycle
# Each map's key and value size and entries. qemus: (tgid, pid namespace inode) -> the agent that added it
# (pid, namespace); meta: a file -> pages per block, current generation, its agent (pid, namespace);
# pidns: one entry, the namespaces of the QEMUs counted but the host's first (pidns.py).
_SIZES = {"qemus": (8, 8, 4096), "meta": (16, 24, 4096), "files": (16, 4, 8192), "threads": (4, 40, 8192),
          "drops": (16, 8, 4096), "pidns": (4, TABLE, 1)}
_KINDS = {"threads": bpf.LRU_HASH, "pidns": bpf.ARRAY}


@dataclass
class Maps:
    """The program's maps: QEMUs counted, images (meta, count maps, drops), each thread's last read, the
    QEMUs' pid namespaces."""

    qemus: bpf.Map
    meta: bpf.Map
    files: bpf.Map
    threads: bpf.Map
    drops: bpf.Map
    pidns: bpf.Map

    NAMES: ClassVar[tuple[str, ...]] = tuple(f"vmc_{name}" for name in _SIZES)

    @classmethod
    def create(cls) -> Maps:
        """New maps. Raises BpfError."""
        made: list[bpf.Map] = []
        try:
            for name, (key, value, entries) in _SIZES.items():
                if name == "files":
                    template = bpf.Map(bpf.HASH, 8, COUNT_VALUE, INNER_ENTRIES, name="vmc_reads_blk",
                                       flags=bpf.NO_PREALLOC)
                    try:
                        made.append(bpf.Map(bpf.HASH_OF_MAPS, key, value, entries, name="vmc_files", inner=template))
                    finally:
                        template.close()
                else:
                    made.append(bpf.Map(_KINDS.get(name, bpf.HASH), key, value, entries, name=f"vmc_{name}"))
        except BaseException:
            for m in made:
                m.close()
            raise
        return cls(*made)

    @classmethod
    def adopt(cls, fds: dict[str, int]) -> Maps:
        """The maps of a program another agent loaded, from descriptors by their names (``vmc_...``)."""
        return cls(*(bpf.Map(0, k, v, n, name=f"vmc_{name}", fd=fds[f"vmc_{name}"])
                     for name, (k, v, n) in _SIZES.items()))

    def close(self) -> None:
        for f in fields(self):
            getattr(self, f.name).close()
