"""The BTF reader: function ids and struct member offsets from a blob written here by the format's rules,
and from this machine's kernel where it has one."""

from __future__ import annotations

import os
import struct

import pytest

from vmcache.errors import HostError
from vmcache.host.btf import VMLINUX, Btf, Member

_INT, _PTR, _ARRAY, _STRUCT, _UNION, _TYPEDEF, _FUNC, _FUNC_PROTO = 1, 2, 3, 4, 5, 8, 12, 13


class Blob:
    """A BTF blob made type by type (ids from 1, in the order added)."""

    def __init__(self) -> None:
        self.types = b""
        self.strings = b"\0"
        self.count = 0

    def name(self, text: str) -> int:
        if not text:
            return 0
        off = len(self.strings)
        self.strings += text.encode() + b"\0"
        return off

    def add(self, kind: int, name: str, size_or_type: int, extra: bytes = b"", vlen: int = 0, flag: int = 0) -> int:
        self.types += struct.pack("<III", self.name(name), (flag << 31) | (kind << 24) | vlen, size_or_type) + extra
        self.count += 1
        return self.count

    def struct(self, name: str, size: int, members: list[tuple[str, int, int]], kind: int = _STRUCT,
               bitfields: bool = False) -> int:
        extra = b"".join(struct.pack("<III", self.name(m), t, off) for m, t, off in members)
        return self.add(kind, name, size, extra, len(members), int(bitfields))

    def blob(self) -> bytes:
        header = struct.pack("<HBBIIIII", 0xEB9F, 1, 0, 24, 0, len(self.types), len(self.types), len(self.strings))
        return header + self.types + self.strings


def kernel_like() -> bytes:
    b = Blob()
    long_ = b.add(_INT, "long", 8, struct.pack("<I", 64))
    uint = b.add(_INT, "unsigned int", 4, struct.pack("<I", 32))
    dev_t = b.add(_TYPEDEF, "dev_t", uint)
    sb = b.struct("super_block", 64, [("s_list", long_, 0), ("s_dev", dev_t, 128)])
    psb = b.add(_PTR, "", sb)
    # inode: i_ino inside an anonymous union at byte 64, as a compiler may lay it out
    union = b.struct("", 8, [("i_ino", long_, 0), ("__i_ino", long_, 0)], kind=_UNION)
    inode = b.struct("inode", 128, [("i_mode", uint, 0), ("i_sb", psb, 320), ("", union, 512)])
    pinode = b.add(_PTR, "", inode)
    mapping = b.struct("address_space", 32, [("host", pinode, 0)])
    pmapping = b.add(_PTR, "", mapping)
    arr = b.add(_ARRAY, "", 0, struct.pack("<III", long_, long_, 3))
    file_ = b.struct("file", 64, [("f_pad", arr, 0), ("f_mapping", pmapping, 192), ("f_flags", uint, 256)])
    pfile = b.add(_PTR, "", file_)
    b.struct("kiocb", 48, [("ki_filp", pfile, 0), ("ki_pos", long_, 64), ("ki_flags", uint, 0x08000000 | 160)],
             bitfields=True)
    proto = b.add(_FUNC_PROTO, "", long_)
    b.add(_FUNC, "filemap_read", proto)
    return b.blob()


NAMES = ("filemap_read", "kiocb", "file", "address_space", "inode", "super_block")


def test_members_through_typedefs_and_anonymous_unions_and_bit_field_offsets() -> None:
    btf = Btf(kernel_like(), NAMES)
    assert btf.func_id("filemap_read") == 16  # the 16th type added
    assert btf.member("kiocb", "ki_filp") == Member(0, 8)
    assert btf.member("kiocb", "ki_pos") == Member(8, 8)
    assert btf.member("kiocb", "ki_flags") == Member(20, 4)  # kind_flag: offset in the low 24 bits
    assert btf.member("file", "f_mapping") == Member(24, 8)
    assert btf.member("file", "f_pad") == Member(0, 24)
    assert btf.member("address_space", "host") == Member(0, 8)
    assert btf.member("inode", "i_ino") == Member(64, 8)  # found inside the anonymous union
    assert btf.member("inode", "i_sb") == Member(40, 8)
    assert btf.member("super_block", "s_dev") == Member(16, 4)  # dev_t: its typedef's size


def test_what_a_kernel_lacks_is_a_lookup_error_and_a_bad_blob_a_host_error() -> None:
    btf = Btf(kernel_like(), NAMES)
    with pytest.raises(LookupError, match="no member ki_nope"):
        btf.member("kiocb", "ki_nope")
    with pytest.raises(LookupError, match="no struct"):
        btf.member("task_struct", "pid")
    with pytest.raises(LookupError, match="no function"):
        btf.func_id("vfs_read")
    with pytest.raises(HostError):
        Btf(b"\0" * 64, NAMES)
    with pytest.raises(HostError, match="no BTF"):
        Btf.vmlinux(NAMES, path="/nonexistent/vmlinux")


@pytest.mark.skipif(not os.path.exists(VMLINUX), reason="this kernel has no BTF")
def test_this_kernel_s_btf_has_what_the_probe_reads() -> None:
    btf = Btf.vmlinux(NAMES)
    assert btf.func_id("filemap_read") > 0
    assert btf.member("kiocb", "ki_pos").size == 8
    assert btf.member("inode", "i_ino").size == 8
    assert btf.member("super_block", "s_dev").size == 4
    assert btf.member("file", "f_mapping").size == 8
