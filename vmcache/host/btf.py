"""The kernel's own type information (BTF, /sys/kernel/btf/vmlinux): function ids and struct offsets.

A program attached to a kernel function (fentry/fexit) is loaded with the
BTF id of that function, and reads the function's arguments by the
offsets of their structs' members in *this* kernel. Both come from the
kernel's BTF blob, a documented format (Documentation/bpf/btf.rst): a
header, an array of types (each a 12-byte ``btf_type`` plus data that
depends on its kind), and a string section. Distribution kernels ship it
(``CONFIG_DEBUG_INFO_BTF``: Debian 12, Ubuntu 22.04/24.04, RHEL 9), so no
kernel headers and no compiler are needed where the agent runs.

Only what the read counter asks is decoded: one pass over the types
records where each one starts and the ids of the functions and structs
whose names were asked for.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from ..errors import HostError

__all__ = ["Btf", "Member", "VMLINUX"]

VMLINUX = "/sys/kernel/btf/vmlinux"
_MAGIC = 0xEB9F
_INT, _PTR, _ARRAY, _STRUCT, _UNION, _ENUM, _FWD, _TYPEDEF = 1, 2, 3, 4, 5, 6, 7, 8
_VOLATILE, _CONST, _RESTRICT, _FUNC, _FUNC_PROTO, _VAR, _DATASEC = 9, 10, 11, 12, 13, 14, 15
_FLOAT, _DECL_TAG, _TYPE_TAG, _ENUM64 = 16, 17, 18, 19
_QUALIFIERS = (_TYPEDEF, _VOLATILE, _CONST, _RESTRICT, _TYPE_TAG)
# Bytes after the 12-byte btf_type: fixed, and per member (vlen of them).
_EXTRA = {_INT: (4, 0), _ARRAY: (12, 0), _STRUCT: (0, 12), _UNION: (0, 12), _ENUM: (0, 8), _FUNC_PROTO: (0, 8),
          _VAR: (4, 0), _DATASEC: (0, 12), _DECL_TAG: (4, 0), _ENUM64: (0, 12)}


class Member(NamedTuple):
    """A struct member as a program reads it: its byte offset from the struct's start and its size."""

    offset: int
    size: int


class Btf:
    """The types of one BTF blob, decoded as far as the read counter needs."""

    def __init__(self, blob: bytes, names: tuple[str, ...]) -> None:
        """Index ``blob``'s types; remember the ids of the functions and structs called ``names``.

        Raises HostError when the blob is not BTF.
        """
        if len(blob) < 24 or struct.unpack_from("<H", blob, 0)[0] != _MAGIC:
            raise HostError("not a BTF blob (bad magic)")
        hdr_len, type_off, type_len, str_off, str_len = struct.unpack_from("<5I", blob, 4)
        self._blob = blob
        self._types = hdr_len + type_off
        self._strings = blob[hdr_len + str_off:hdr_len + str_off + str_len]
        wanted = {off: name for name in names if (off := self._string_offset(name)) is not None}
        self._starts = [0]  # type id -> its offset in the blob (id 0 is void)
        self._named: dict[tuple[int, str], int] = {}
        pos, end = self._types, self._types + type_len
        while pos < end:
            name_off, info = struct.unpack_from("<II", blob, pos)
            kind, vlen = (info >> 24) & 0x1F, info & 0xFFFF
            if name_off in wanted and kind in (_FUNC, _STRUCT, _UNION):
                self._named.setdefault((kind if kind == _FUNC else _STRUCT, wanted[name_off]), len(self._starts))
            self._starts.append(pos)
            fixed, each = _EXTRA.get(kind, (0, 0))
            pos += 12 + fixed + each * vlen

    @classmethod
    def vmlinux(cls, names: tuple[str, ...], path: str = VMLINUX) -> Btf:
        """The running kernel's BTF. Raises HostError (none: a kernel built without CONFIG_DEBUG_INFO_BTF)."""
        try:
            with open(path, "rb") as f:
                blob = f.read()
        except OSError as err:
            raise HostError(f"this kernel has no BTF ({err.strerror})", path=path, errno=err.errno) from err
        return cls(blob, names)

    def _string_offset(self, name: str) -> int | None:
        at = self._strings.find(b"\0" + name.encode() + b"\0")
        return at + 1 if at >= 0 else None

    def _name(self, off: int) -> str:
        return self._strings[off:self._strings.index(b"\0", off)].decode()

    def _type(self, ident: int) -> tuple[int, int, int, int, int]:
        """(kind, vlen, kind_flag, size or type, offset of its extra data) of type ``ident``."""
        pos = self._starts[ident]
        _name_off, info, size_or_type = struct.unpack_from("<III", self._blob, pos)
        return (info >> 24) & 0x1F, info & 0xFFFF, info >> 31, size_or_type, pos + 12

    def func_id(self, name: str) -> int:
        """The BTF id of the kernel function ``name``. Raises LookupError when it has none (not in this kernel)."""
        try:
            return self._named[(_FUNC, name)]
        except KeyError:
            raise LookupError(f"no function {name} in the kernel's BTF") from None

    def member(self, struct_name: str, path: str) -> Member:
        """Offset and size of ``struct_name.path`` (one member name, or several joined by dots through
        members that are structs themselves); members of anonymous structs and unions are found as the
        compiler finds them. Raises LookupError (no such struct or member, or a bit field)."""
        try:
            ident = self._named[(_STRUCT, struct_name)]
        except KeyError:
            raise LookupError(f"no struct {struct_name} in the kernel's BTF") from None
        offset = 0
        for name in path.split("."):
            found = self._find_member(ident, name)
            if found is None:
                raise LookupError(f"no member {name} in struct {struct_name} ({path})")
            bit_offset, ident = found
            if bit_offset % 8:
                raise LookupError(f"{struct_name}.{path} is a bit field")
            offset += bit_offset // 8
        return Member(offset, self._size(ident))

    def _find_member(self, ident: int, name: str) -> tuple[int, int] | None:
        """(bit offset, type id) of member ``name`` of the struct or union ``ident``, anonymous ones searched."""
        kind, vlen, kind_flag, _size, extra = self._type(self._resolve(ident))
        if kind not in (_STRUCT, _UNION):
            return None
        for i in range(vlen):
            name_off, member_type, raw = struct.unpack_from("<III", self._blob, extra + 12 * i)
            bit_offset = raw & 0xFFFFFF if kind_flag else raw
            if name_off and self._name(name_off) == name:
                return bit_offset, member_type
            if not name_off:  # an anonymous struct or union: its members are the outer struct's
                inner = self._find_member(member_type, name)
                if inner is not None:
                    return bit_offset + inner[0], inner[1]
        return None

    def _resolve(self, ident: int) -> int:
        """``ident`` with typedefs and qualifiers taken off."""
        while ident:
            kind, _vlen, _flag, size_or_type, _extra = self._type(ident)
            if kind not in _QUALIFIERS:
                return ident
            ident = size_or_type
        return ident

    def _size(self, ident: int) -> int:
        """The size in bytes of type ``ident`` (a pointer: 8)."""
        kind, _vlen, _flag, size_or_type, extra = self._type(self._resolve(ident))
        if kind == _PTR:
            return 8
        if kind == _ARRAY:
            elem, _index, count = struct.unpack_from("<III", self._blob, extra)
            return self._size(elem) * int(count)
        return int(size_or_type)
