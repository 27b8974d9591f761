"""bpf(2) and perf_event_open(2) through ctypes: maps, programs, their attachment.

No libbpf, no compiler, no kernel headers: vmcache's programs
(:mod:`vmcache.host.readprog`) are a few dozen instructions written with
a small assembler (:mod:`vmcache.host.bpfasm`), loaded with BPF_PROG_LOAD
and attached to tracepoints with perf_event_open(PERF_TYPE_TRACEPOINT) +
BPF_LINK_CREATE, or to a kernel function's entry or exit (a TRACING
program, by the function's BTF id) with BPF_RAW_TRACEPOINT_OPEN.
Every object is a file descriptor (close-on-exec) of this process: when
it closes, or the process dies (SIGKILL included), the kernel drops the
object with its last reference; nothing is pinned in bpffs.

Errors are OSError from the kernel translated into :class:`BpfError`
(a HostError) carrying the errno and, for a refused program, the
verifier's log.
"""

from __future__ import annotations

import ctypes
import errno as _errno
import os
import struct
from collections.abc import Iterator

from ..errors import HostError

__all__ = [
    "BpfError", "Map", "HASH", "LRU_HASH", "ARRAY", "HASH_OF_MAPS", "NO_PREALLOC",
    "load_tracepoint_program", "attach_tracepoint", "load_tracing_program", "attach_tracing",
    "object_ids", "fd_by_id", "object_info", "program_name",
    "program_names", "map_id", "map_name", "PROG", "MAP", "LINK", "NOEXIST",
]

_NR = {"x86_64": (321, 298), "aarch64": (280, 241)}.get(os.uname().machine, (None, None))
_NR_BPF, _NR_PERF_EVENT_OPEN = _NR
_syscall = ctypes.CDLL(None, use_errno=True).syscall
_syscall.restype = ctypes.c_long

# bpf(2) commands (include/uapi/linux/bpf.h)
_MAP_CREATE, _MAP_LOOKUP_ELEM, _MAP_UPDATE_ELEM, _MAP_DELETE_ELEM, _MAP_GET_NEXT_KEY = 0, 1, 2, 3, 4
_PROG_LOAD, _PROG_GET_NEXT_ID, _PROG_GET_FD_BY_ID, _MAP_GET_FD_BY_ID, _OBJ_GET_INFO_BY_FD = 5, 11, 13, 14, 15
_RAW_TRACEPOINT_OPEN = 17
_MAP_LOOKUP_AND_DELETE_BATCH, _LINK_CREATE, _LINK_GET_FD_BY_ID, _LINK_GET_NEXT_ID = 25, 28, 30, 31

HASH, ARRAY, LRU_HASH, HASH_OF_MAPS = 1, 2, 9, 13
NO_PREALLOC = 1
NOEXIST = 1  # map_update_elem flag: only create
_PROG_TYPE_TRACEPOINT, _PROG_TYPE_TRACING = 5, 26
_TRACE_FENTRY, _TRACE_FEXIT = 24, 25
_ATTACH_PERF_EVENT = 41
_PERF_TYPE_TRACEPOINT = 2
_PERF_FLAG_FD_CLOEXEC = 8
_PERF_EVENT_IOC_ENABLE = 0x2400


class BpfError(HostError):
    """A bpf(2) or perf_event_open(2) call failed; ``log`` holds the verifier's words for a refused program."""

    def __init__(self, message: str, *, errno: int | None = None, log: str = "") -> None:
        super().__init__(message, errno=errno)
        self.log = log


def _bpf(cmd: int, attr: ctypes.Array[ctypes.c_char], what: str) -> int:
    if _NR_BPF is None:
        raise BpfError(f"{what}: bpf(2) is not known on {os.uname().machine}", errno=_errno.ENOSYS)
    ret = _syscall(_NR_BPF, cmd, attr, len(attr))
    if ret < 0:
        err = ctypes.get_errno()
        raise BpfError(f"{what}: {os.strerror(err)}", errno=err)
    return int(ret)


def _attr(fmt: str, *values: object, size: int = 128) -> ctypes.Array[ctypes.c_char]:
    """A zeroed bpf_attr of ``size`` bytes starting with ``values`` packed as ``fmt`` (native order)."""
    buf = ctypes.create_string_buffer(size)
    struct.pack_into("=" + fmt, buf, 0, *values)
    return buf


def _addr(buf: ctypes.Array[ctypes.c_char] | None) -> int:
    return ctypes.addressof(buf) if buf is not None else 0


class Map:
    """A BPF map owned by this process (closed with :meth:`close` or at exit)."""

    def __init__(self, kind: int, key_size: int, value_size: int, max_entries: int, *, name: str,
                 flags: int = 0, inner: Map | None = None, fd: int | None = None) -> None:
        """Create the map (or take ``fd``, an existing map's, as it is); raises BpfError."""
        self.key_size, self.value_size, self.max_entries, self.name = key_size, value_size, max_entries, name
        if fd is not None:
            self.fd = fd
            return
        attr = _attr("IIIIII", kind, key_size, value_size, max_entries, flags, inner.fd if inner else 0)
        struct.pack_into("16s", attr, 28, name.encode()[:15])
        self.fd = _bpf(_MAP_CREATE, attr, f"map {name}")

    @property
    def ident(self) -> int:
        """The map's id on the host. Raises BpfError."""
        return map_id(self.fd)

    def _elem(self, cmd: int, key: bytes, value: ctypes.Array[ctypes.c_char] | None, flags: int, what: str) -> int:
        kbuf = ctypes.create_string_buffer(key, len(key))
        return _bpf(cmd, _attr("IIQQQ", self.fd, 0, _addr(kbuf), _addr(value), flags), what)

    def update(self, key: bytes, value: bytes | int) -> None:
        """Set ``key`` to ``value`` (created if absent; an int is a map's fd, for a map of maps).

        Raises BpfError (E2BIG: the map is full).
        """
        raw = struct.pack("=I", value) if isinstance(value, int) else value
        self._elem(_MAP_UPDATE_ELEM, key, ctypes.create_string_buffer(raw, len(raw)), 0, f"{self.name} update")

    def lookup(self, key: bytes) -> bytes | None:
        """The value of ``key`` (a map of maps: the inner map's id), None when absent. Raises BpfError."""
        value = ctypes.create_string_buffer(self.value_size)
        try:
            self._elem(_MAP_LOOKUP_ELEM, key, value, 0, "map lookup")
        except BpfError as err:
            if err.errno == _errno.ENOENT:
                return None
            raise
        return value.raw

    def delete(self, key: bytes) -> bool:
        """Remove ``key``; False when it was not there. Raises BpfError."""
        try:
            self._elem(_MAP_DELETE_ELEM, key, None, 0, "map delete")
        except BpfError as err:
            if err.errno == _errno.ENOENT:
                return False
            raise
        return True

    def drain(self, batch: int = 4096) -> Iterator[tuple[bytes, bytes]]:
        """Every (key, value) of a hash map, each removed as it is read (BPF_MAP_LOOKUP_AND_DELETE_BATCH).

        Raises BpfError.
        """
        keys = ctypes.create_string_buffer(self.key_size * batch)
        values = ctypes.create_string_buffer(self.value_size * batch)
        token = ctypes.create_string_buffer(max(self.key_size, 8))
        first = True
        while True:
            attr = _attr("QQQQII", 0 if first else _addr(token), _addr(token), _addr(keys), _addr(values),
                         batch, self.fd)
            try:
                _bpf(_MAP_LOOKUP_AND_DELETE_BATCH, attr, "map drain")
                done = False
            except BpfError as err:
                if err.errno != _errno.ENOENT:
                    raise
                done = True  # the last batch (possibly empty) comes with ENOENT
            count = struct.unpack_from("=I", attr, 32)[0]
            for i in range(count):
                yield (keys.raw[i * self.key_size:(i + 1) * self.key_size],
                       values.raw[i * self.value_size:(i + 1) * self.value_size])
            if done:
                return
            first = False

    def keys(self) -> list[bytes]:
        """Every key now in the map. Raises BpfError."""
        out: list[bytes] = []
        prev = None
        while True:
            nxt = ctypes.create_string_buffer(self.key_size)
            kbuf = ctypes.create_string_buffer(prev, self.key_size) if prev is not None else None
            try:
                _bpf(_MAP_GET_NEXT_KEY, _attr("IIQQ", self.fd, 0, _addr(kbuf), _addr(nxt)), f"{self.name} keys")
            except BpfError as err:
                if err.errno == _errno.ENOENT:
                    return out
                raise
            prev = nxt.raw
            out.append(prev)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _load(code: bytes, name: str, prog_type: int, attach_type: int = 0, btf_id: int = 0) -> int:
    license_ = ctypes.create_string_buffer(b"GPL")
    insns = ctypes.create_string_buffer(code, len(code))
    log = ctypes.create_string_buffer(1 << 16)
    attr = _attr("IIQQIIQII16sIIIIQIIQII", prog_type, len(code) // 8, _addr(insns), _addr(license_),
                 1, len(log), _addr(log), 0, 0, name.encode()[:15], 0, attach_type, 0, 0, 0, 0, 0, 0, 0, btf_id)
    try:
        return _bpf(_PROG_LOAD, attr, f"program {name}")
    except BpfError as err:
        err.log = log.value.decode(errors="replace")
        raise


def load_tracepoint_program(code: bytes, *, name: str) -> int:
    """Load ``code`` as a TRACEPOINT program (license GPL: the helpers need it); its fd.

    Raises BpfError with the verifier's log when the kernel refuses it.
    """
    return _load(code, name, _PROG_TYPE_TRACEPOINT)


def load_tracing_program(code: bytes, *, name: str, btf_id: int, at_exit: bool) -> int:
    """Load ``code`` as a TRACING program on the entry (fentry) or, ``at_exit``, the return (fexit) of the
    kernel function whose BTF id is ``btf_id``; its fd. The program's context is the function's
    arguments as u64s (and, at exit, its return value after them).

    Raises BpfError with the verifier's log when the kernel refuses it (also: no BPF trampoline).
    """
    return _load(code, name, _PROG_TYPE_TRACING, _TRACE_FEXIT if at_exit else _TRACE_FENTRY, btf_id)


def attach_tracing(prog_fd: int) -> int:
    """Attach a TRACING program to the function it was loaded for; the link's fd. Raises BpfError."""
    return _bpf(_RAW_TRACEPOINT_OPEN, _attr("QI", 0, prog_fd), "attach to a kernel function")


def attach_tracepoint(prog_fd: int, event_id: int) -> int:
    """Attach the program to the tracepoint whose perf event id is ``event_id``; the link's fd.

    The perf event (CPU 0: a tracepoint's program runs on every CPU) is
    held by the link and goes with it. Raises BpfError.
    """
    attr = ctypes.create_string_buffer(128)
    # perf_event_attr: type, size, config, sample_period, sample_type (PERF_SAMPLE_RAW), ..., wakeup_events
    struct.pack_into("=IIQQQ", attr, 0, _PERF_TYPE_TRACEPOINT, 128, event_id, 1, 1 << 10)
    struct.pack_into("=I", attr, 48, 1)
    if _NR_PERF_EVENT_OPEN is None:
        raise BpfError("perf_event_open: not known on this machine", errno=_errno.ENOSYS)
    pfd = _syscall(_NR_PERF_EVENT_OPEN, attr, -1, 0, -1, _PERF_FLAG_FD_CLOEXEC)
    if pfd < 0:
        err = ctypes.get_errno()
        raise BpfError(f"perf_event_open of tracepoint {event_id}: {os.strerror(err)}", errno=err)
    try:
        link = _bpf(_LINK_CREATE, _attr("IIII", prog_fd, pfd, _ATTACH_PERF_EVENT, 0), "link")
        try:
            import fcntl

            fcntl.ioctl(pfd, _PERF_EVENT_IOC_ENABLE, 0)
        except OSError as err:
            os.close(link)
            raise BpfError(f"enable tracepoint {event_id}: {err.strerror}", errno=err.errno) from err
        return link
    finally:
        os.close(pfd)


# -- objects loaded on the host, by id ---------------------------------------------------------

PROG, MAP, LINK = "program", "map", "link"
_NEXT_ID = {PROG: _PROG_GET_NEXT_ID, LINK: _LINK_GET_NEXT_ID}
_FD_BY_ID = {PROG: _PROG_GET_FD_BY_ID, MAP: _MAP_GET_FD_BY_ID, LINK: _LINK_GET_FD_BY_ID}


def object_ids(kind: str) -> list[int]:
    """The ids of every BPF program (``PROG``) or link (``LINK``) on the host (root). Raises BpfError."""
    ids: list[int] = []
    start = 0
    while True:
        attr = _attr("III", start, 0, 0)
        try:
            _bpf(_NEXT_ID[kind], attr, f"{kind} ids")
        except BpfError as err:
            if err.errno == _errno.ENOENT:
                return ids
            raise
        start = struct.unpack_from("=I", attr, 4)[0]
        ids.append(start)


def fd_by_id(kind: str, ident: int) -> int | None:
    """A new fd of the program, map or link ``ident``; None when it is gone. Raises BpfError."""
    try:
        return _bpf(_FD_BY_ID[kind], _attr("I", ident), f"{kind} {ident}")
    except BpfError as err:
        if err.errno == _errno.ENOENT:
            return None
        raise


def object_info(fd: int, size: int = 256, *, map_ids: int = 0) -> tuple[bytes, list[int]]:
    """bpf_*_info of ``fd`` (its raw bytes) and, for a program, up to ``map_ids`` ids of its maps.

    Raises BpfError.
    """
    info = ctypes.create_string_buffer(size)
    ids = (ctypes.c_uint32 * max(1, map_ids))()
    if map_ids:  # bpf_prog_info: nr_map_ids at 52, map_ids at 56
        struct.pack_into("=IQ", info, 52, map_ids, ctypes.addressof(ids))
    _bpf(_OBJ_GET_INFO_BY_FD, _attr("IIQ", fd, size, _addr(info)), "object info")
    count = struct.unpack_from("=I", info, 52)[0] if map_ids else 0
    return info.raw, list(ids)[:min(count, map_ids)]


def map_id(fd: int) -> int:
    """The id of the map ``fd``. Raises BpfError."""
    return int(struct.unpack_from("=I", object_info(fd, 80)[0], 4)[0])


def map_name(fd: int) -> str:
    """The name of the map ``fd``. Raises BpfError."""
    return object_info(fd, 80)[0][24:40].split(b"\0", 1)[0].decode(errors="replace")


def program_name(info: bytes) -> str:
    """The name in a bpf_prog_info."""
    return info[64:80].split(b"\0", 1)[0].decode(errors="replace")


def program_names() -> list[str]:
    """The names of every program on the host, in id order (root). Raises BpfError."""
    names = []
    for ident in object_ids(PROG):
        fd = fd_by_id(PROG, ident)
        if fd is not None:
            try:
                names.append(program_name(object_info(fd)[0]))
            finally:
                os.close(fd)
    return names
