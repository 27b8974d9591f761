"""The host's one set of read-counting programs: found where another agent loaded it, else loaded; and the
entries of agents that died without removing them, swept.

Agents find a set by its programs' name (:attr:`ReadSet.NAME`); nothing is
pinned in bpffs, so a set lives while an agent holds a descriptor of it.
"""

from __future__ import annotations

import errno as _errno
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass

from . import bpf
from .pidns import PidNs
from .readmaps import Maps
from .readsets import NoReadSet, ReadSet

__all__ = ["Found", "find_set", "load_set", "sweep", "close_all"]


@dataclass(frozen=True)
class Found:
    """A set another agent holds: which one, descriptors of its links and of its maps by name."""

    kind: type[ReadSet]
    links: list[int]
    maps: dict[str, int]


def find_set(order: tuple[type[ReadSet], ...]) -> Found | None:
    """The links and maps of a set another agent loaded and still holds; None when there is none."""
    kinds = {kind.NAME: kind for kind in order}
    progs: dict[int, tuple[type[ReadSet], list[int]]] = {}  # program id -> its set, its map ids
    for ident in bpf.object_ids(bpf.PROG):
        fd = bpf.fd_by_id(bpf.PROG, ident)
        if fd is None:
            continue
        try:
            info, map_ids = bpf.object_info(fd, map_ids=16)
        finally:
            os.close(fd)
        kind = kinds.get(bpf.program_name(info))
        if kind is not None:
            progs[ident] = (kind, map_ids)
    for kind in order:
        found = _complete(kind, {p: ids for p, (k, ids) in progs.items() if k is kind})
        if found is not None:
            return found
    return None


def _complete(kind: type[ReadSet], progs: dict[int, list[int]]) -> Found | None:
    """The set ``kind`` of the programs ``progs`` (id -> map ids) when one is whole; else None.

    A set's programs are those that share its ``vmc_qemus`` map (every program's first look-up); each
    uses only some of the maps (the probe's entry program neither counts nor drops), so the set's maps
    are those of all of them.
    """
    if not progs:
        return None
    first = _maps_by_name(next(iter(progs.values())))
    qemus = bpf.map_id(first["vmc_qemus"]) if "vmc_qemus" in first else None
    close_all(first.values())
    members = {p: ids for p, ids in progs.items() if qemus in ids}
    maps = _maps_by_name(sorted({i for ids in members.values() for i in ids}))
    if set(maps) < set(Maps.NAMES):
        close_all(maps.values())
        return None
    links = _links_of(set(members))
    if len(links) != kind.LINKS:  # being loaded, or half gone: load a set of one's own
        close_all([*links, *maps.values()])
        return None
    return Found(kind, links, maps)


def close_all(fds: Iterable[int]) -> None:
    for fd in fds:
        os.close(fd)


def _links_of(prog_ids: set[int]) -> list[int]:
    links = []
    for ident in bpf.object_ids(bpf.LINK):
        fd = bpf.fd_by_id(bpf.LINK, ident)
        if fd is None:
            continue
        if struct.unpack_from("=I", bpf.object_info(fd, 64)[0], 8)[0] in prog_ids:
            links.append(fd)
        else:
            os.close(fd)
    return links


def _maps_by_name(ids: list[int]) -> dict[str, int]:
    out = {}
    for ident in ids:
        fd = bpf.fd_by_id(bpf.MAP, ident)
        if fd is None:
            continue
        name = bpf.map_name(fd)
        if name in Maps.NAMES and name not in out:
            out[name] = fd
        else:
            os.close(fd)
    return out


def load_set(order: tuple[type[ReadSet], ...]) -> tuple[Maps, list[int], ReadSet]:
    """The maps, and the first set of ``order`` this kernel loads and attaches. Raises NoReadSet (every
    set's reason), BpfError (the maps refused)."""
    maps = Maps.create()
    reasons, errno = [], _errno.ENOENT
    try:
        for kind in order:
            try:
                readset = kind.for_kernel()
                return maps, readset.load(maps), readset
            except (NoReadSet, bpf.BpfError) as err:
                reasons.append(f"{kind.SIGNAL}: {err}")
                errno = err.errno or errno
    except BaseException:
        maps.close()
        raise
    maps.close()
    raise NoReadSet("; ".join(reasons), errno=errno)


def sweep(maps: Maps, ns: PidNs) -> None:
    """Remove entries of agents of ``ns`` that died without removing them (SIGKILL): their QEMUs and images.
    Another namespace's agents are not seen from this one: their entries stay."""
    for key in maps.qemus.keys():
        value = maps.qemus.lookup(key)
        if value is not None and not _alive(ns.owns(value)):
            maps.qemus.delete(key)
    for key in maps.meta.keys():
        value = maps.meta.lookup(key)
        if value is not None and not _alive(ns.owns(value, 12)):
            maps.meta.delete(key)
            maps.drops.delete(key)
            for gen in (0, 1):
                maps.files.delete(key[:12] + struct.pack("=I", gen))
    ns.release(maps.pidns, maps.qemus)


def _alive(pid: int | None) -> bool:
    """True for a live process, and for None (another namespace's, which this one cannot see)."""
    return pid is None or os.path.exists(f"/proc/{pid}")
