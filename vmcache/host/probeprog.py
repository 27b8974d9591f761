"""The read counter's programs on ``filemap_read``, the buffered read path of files and block devices.

``ssize_t filemap_read(struct kiocb *iocb, struct iov_iter *iter, ssize_t
already_read)`` is global, not inlined, and has kept this signature since
Linux 5.13; every buffered read of a regular file, and from 5.19 of a
block device, goes through it once per request. So where the page-cache
tracepoints of :mod:`vmcache.host.readprog` are missing (before 6.12),
two TRACING programs on it count the same things:

- at entry (fentry): the thread starts reading the iocb's file: pages
  entering that file's cache from now on are its misses (the
  ``mm_filemap_add_to_page_cache`` program of readprog counts them);
- at return (fexit): the thread read ``n = ret - already_read`` bytes,
  which end at ``iocb->ki_pos`` (filemap_read advanced it by them): pages
  ``(ki_pos - n) / 4096 .. (ki_pos - 1) / 4096`` are counted once, hits and
  misses alike, and the mark ends.

The file is the one whose page cache is read, ``ki_filp->f_mapping->host``
(a block device's is the kernel's bdev inode, not the /dev node's), named
by its ``i_ino`` and ``i_sb->s_dev`` as the tracepoints name it. Offsets
come from the kernel's BTF (:mod:`vmcache.host.btf`); the verifier checks
each load against the same types.
"""

from __future__ import annotations

from dataclasses import dataclass

from .bpfasm import Asm
from .btf import Btf, Member
from .readmaps import Maps
from .readprog import KeyLoader, count_read, mark_reading, program, unmark_reading, watched

__all__ = ["FUNCTION", "STRUCTS", "Offsets", "iocb_key", "entry_program", "exit_program"]

FUNCTION = "filemap_read"
STRUCTS = ("kiocb", "file", "address_space", "inode", "super_block")
PAGE_SHIFT = 12
# fexit's context: the three arguments, then the return value (u64 each).
_IOCB, _ALREADY, _RET = 0, 16, 24


@dataclass(frozen=True)
class Offsets:
    """Where this kernel keeps what the programs read: (offset, size) of each member."""

    ki_filp: int
    ki_pos: int
    f_mapping: int
    host: int
    i_ino: Member
    i_sb: int
    s_dev: int

    @classmethod
    def of(cls, btf: Btf) -> Offsets:
        """The offsets in ``btf``. Raises LookupError (a member this kernel does not have)."""
        return cls(btf.member("kiocb", "ki_filp").offset, btf.member("kiocb", "ki_pos").offset,
                   btf.member("file", "f_mapping").offset, btf.member("address_space", "host").offset,
                   btf.member("inode", "i_ino"), btf.member("inode", "i_sb").offset,
                   btf.member("super_block", "s_dev").offset)


def iocb_key(off: Offsets) -> KeyLoader:
    """The file an iocb reads: ``ki_filp->f_mapping->host``'s ``i_ino`` and ``i_sb->s_dev``."""

    def emit(a: Asm, slot: int) -> None:
        a.load(1, 6, _IOCB, 8)
        a.load(1, 1, off.ki_filp, 8)
        a.load(1, 1, off.f_mapping, 8)
        a.load(1, 1, off.host, 8)
        a.load(2, 1, off.i_ino.offset, off.i_ino.size)
        a.store(10, slot, 2, 8)
        a.load(1, 1, off.i_sb, 8)
        a.load(1, 1, off.s_dev, 4)
        a.store(10, slot + 8, 1, 4)
    return emit


def entry_program(maps: Maps, off: Offsets) -> bytes:
    """fentry: a registered QEMU's thread starts a read of a watched file."""

    def body(a: Asm) -> None:
        watched(a, maps, iocb_key(off))
        mark_reading(a, maps, "fe")
    return program(body, maps)


def exit_program(maps: Maps, off: Offsets) -> bytes:
    """fexit: the read's pages counted, its mark ended."""

    def body(a: Asm) -> None:
        watched(a, maps, iocb_key(off))
        unmark_reading(a, maps)
        a.load(7, 6, _RET, 8)
        a.load(1, 6, _ALREADY, 8)
        a.alu("sub", 7, ("r", 1))  # r7 = the bytes this call read
        a.jump("sle", 7, 0, "out")
        a.load(1, 6, _IOCB, 8)
        a.load(2, 1, off.ki_pos, 8)  # r2 = where they end
        a.mov(1, ("r", 2))
        a.alu("sub", 1, ("r", 7))
        a.alu("rsh", 1, PAGE_SHIFT)
        a.alu("sub", 2, 1)
        a.alu("rsh", 2, PAGE_SHIFT)
        count_read(a, maps, 1, 2, "fx")
    return program(body, maps)
