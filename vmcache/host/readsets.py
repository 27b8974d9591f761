"""The two program sets the read counter can run, and how each one is loaded on this kernel.

A buffered read can be seen two ways, and the counter tries them in this
order (:data:`ORDER`):

- ``probe`` (:class:`ProbeSet`): fentry and fexit programs on
  ``filemap_read`` (:mod:`vmcache.host.probeprog`), exact per request,
  on every kernel since 5.13 that has BTF and BPF trampolines (Debian 12,
  Ubuntu 22.04/24.04, RHEL 9 and newer);
- ``tracepoint`` (:class:`TracepointSet`): programs on
  ``filemap:mm_filemap_get_pages`` and the readahead tracepoints
  (:mod:`vmcache.host.readprog`), Linux 6.12 and newer, where a kernel
  refuses the probe (no BTF, no trampoline, or a host that forbids them,
  as this project's 6.18 test machine does).

Both count misses with the same program on
``filemap:mm_filemap_add_to_page_cache`` (3.10; its ``order`` field 5.17)
and fill the same maps, so the rest of the counter does not know which
set runs. Each set is found on the host by its programs' name, loaded by
the first agent, and asked how to probe a file's page-cache identity
(:func:`vmcache.host.cachekey.cache_key`).
"""

from __future__ import annotations

import errno as _errno
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from functools import partial
from typing import ClassVar

from ..errors import HostError
from . import bpf
from .btf import Btf
from .probeprog import FUNCTION, STRUCTS, Offsets, entry_program, exit_program, iocb_key
from .readmaps import Maps
from .readprog import EVENTS, KeyLoader, added, program, programs, record_key
from .tracefs import Tracepoint, read_tracepoints

__all__ = ["ReadSet", "ProbeSet", "TracepointSet", "ORDER", "NoReadSet"]

_ADD = ("filemap", "mm_filemap_add_to_page_cache")


class NoReadSet(HostError):
    """This kernel cannot run a program set (no BTF, no tracepoint, refused); the message says why."""


class ReadSet(ABC):
    """One way of counting reads on this kernel: its programs, their attachment, its key probe."""

    #: The programs' name on the host (agents find a loaded set by it; a new layout, a new name).
    NAME: ClassVar[str]
    #: What ``vmcache status`` and the ``read_signal`` label call it.
    SIGNAL: ClassVar[str]
    #: How many links a complete set has.
    LINKS: ClassVar[int]

    @classmethod
    @abstractmethod
    def for_kernel(cls) -> ReadSet:
        """What the running kernel offers this set. Raises NoReadSet."""

    @abstractmethod
    def load(self, maps: Maps) -> list[int]:
        """Load and attach every program of the set over ``maps``; the links' fds. Raises BpfError."""

    @property
    @abstractmethod
    def key(self) -> KeyLoader:
        """How the key probe's program reads the file from its context."""

    @abstractmethod
    def attach_probe(self, code: bytes, name: str) -> int:
        """Load ``code`` (a program with :attr:`key`'s context) where the set counts reads; its link. Raises
        BpfError."""


def _links(attachers: list[Callable[[], int]]) -> list[int]:
    """Each attacher's link, in order; when one fails, the links made so far are closed."""
    links: list[int] = []
    try:
        for attach in attachers:
            links.append(attach())
    except BaseException:
        for fd in links:
            os.close(fd)
        raise
    return links


def _tracepoint_link(code: bytes, name: str, point: Tracepoint) -> int:
    prog = bpf.load_tracepoint_program(code, name=name)
    try:
        return bpf.attach_tracepoint(prog, point.id)
    finally:
        os.close(prog)  # the link holds it


def _tracepoints(events: list[tuple[str, str]]) -> dict[str, Tracepoint]:
    try:
        points = read_tracepoints(events)
    except HostError as err:
        raise NoReadSet(str(err), errno=err.errno) from err
    missing = [f"{g}:{n}" for g, n in events if n not in points]
    if missing:
        raise NoReadSet(f"this kernel has no tracepoint {', '.join(missing)}", errno=_errno.ENOENT)
    return points


class ProbeSet(ReadSet):
    """fentry/fexit on ``filemap_read`` and the add_to_page_cache tracepoint (3 links)."""

    NAME = "vmcache_fread2"
    SIGNAL = "probe"
    LINKS = 3

    def __init__(self, func_id: int, offsets: Offsets, add: Tracepoint) -> None:
        self.func_id, self.offsets, self.add = func_id, offsets, add

    @classmethod
    def for_kernel(cls) -> ProbeSet:
        try:
            btf = Btf.vmlinux((FUNCTION, *STRUCTS))
            func_id, offsets = btf.func_id(FUNCTION), Offsets.of(btf)
        except (HostError, LookupError) as err:
            raise NoReadSet(str(err), errno=getattr(err, "errno", None)) from err
        return cls(func_id, offsets, _tracepoints([_ADD])[_ADD[1]])

    def _traced(self, code: bytes, name: str, *, at_exit: bool) -> int:
        prog = bpf.load_tracing_program(code, name=name, btf_id=self.func_id, at_exit=at_exit)
        try:
            return bpf.attach_tracing(prog)
        finally:
            os.close(prog)

    def load(self, maps: Maps) -> list[int]:
        return _links([lambda: self._traced(entry_program(maps, self.offsets), self.NAME, at_exit=False),
                       lambda: self._traced(exit_program(maps, self.offsets), self.NAME, at_exit=True),
                       lambda: _tracepoint_link(program(lambda a: added(a, maps, self.add), maps), self.NAME,
                                                self.add)])

    @property
    def key(self) -> KeyLoader:
        return iocb_key(self.offsets)

    def attach_probe(self, code: bytes, name: str) -> int:
        return self._traced(code, name, at_exit=True)


class TracepointSet(ReadSet):
    """``mm_filemap_get_pages``, add_to_page_cache and the two readahead tracepoints (4 links)."""

    NAME = "vmcache_reads2"
    SIGNAL = "tracepoint"
    LINKS = len(EVENTS)

    def __init__(self, points: dict[str, Tracepoint]) -> None:
        self.points = points

    @classmethod
    def for_kernel(cls) -> TracepointSet:
        return cls(_tracepoints(list(EVENTS)))

    def load(self, maps: Maps) -> list[int]:
        return _links([partial(_tracepoint_link, code, self.NAME, self.points[name])
                       for name, code in programs(maps, self.points).items()])

    @property
    def key(self) -> KeyLoader:
        return record_key(self.points[EVENTS[0][1]])

    def attach_probe(self, code: bytes, name: str) -> int:
        return _tracepoint_link(code, name, self.points[EVENTS[0][1]])


#: The sets in the order the counter tries them.
ORDER: tuple[type[ReadSet], ...] = (ProbeSet, TracepointSet)
