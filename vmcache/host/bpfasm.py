"""A small BPF assembler: the instructions vmcache's programs use, jumps to named labels.

Enough for the read counter's programs (:mod:`vmcache.host.readprog`) and
the cache-key probe (:mod:`vmcache.host.cachekey`): 64-bit ALU, loads and
stores, atomic add, 64-bit immediates, map addresses, helper calls,
conditional jumps.
Encoding: include/uapi/linux/bpf.h and Documentation/bpf/standardization.
"""

from __future__ import annotations

import struct

from .bpf import Map

__all__ = ["Asm", "LOOKUP", "UPDATE", "DELETE", "PID_TGID", "NS_PID_TGID"]

# Helper function numbers (NS_PID_TGID: bpf_get_ns_current_pid_tgid, Linux 5.7).
LOOKUP, UPDATE, DELETE, PID_TGID, NS_PID_TGID = 1, 2, 3, 14, 120

_LDX, _STX, _ST, _ALU64, _JMP = 0x01, 0x03, 0x02, 0x07, 0x05
_MEM, _ATOMIC = 0x60, 0xC0
_SIZES = {1: 0x10, 2: 0x08, 4: 0x00, 8: 0x18}
_ALU = {"add": 0x00, "sub": 0x10, "mul": 0x20, "div": 0x30, "or": 0x40, "and": 0x50, "lsh": 0x60,
        "rsh": 0x70, "mod": 0x90, "xor": 0xA0, "mov": 0xB0}
_JUMPS = {"ja": 0x00, "eq": 0x10, "gt": 0x20, "ge": 0x30, "ne": 0x50, "lt": 0xA0, "le": 0xB0,
          "sgt": 0x60, "sge": 0x70, "slt": 0xC0, "sle": 0xD0}


class Asm:
    """A BPF program being written: one method per instruction kind, jumps to named labels.

    Registers are 0-10 (r10 the frame pointer); ``src`` of ALU and jump
    instructions is a register when given as ``("r", n)``, else an immediate.
    """

    def __init__(self) -> None:
        self._insns: list[list[int]] = []  # [code, dst, src, off, imm]
        self._labels: dict[str, int] = {}
        self._fixups: list[tuple[int, str]] = []

    def _emit(self, code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> None:
        self._insns.append([code, dst, src, off, imm])

    def label(self, name: str) -> None:
        self._labels[name] = len(self._insns)

    def alu(self, op: str, dst: int, src: int | tuple[str, int]) -> None:
        if isinstance(src, tuple):
            self._emit(_ALU64 | _ALU[op] | 0x08, dst, src[1])
        else:
            self._emit(_ALU64 | _ALU[op], dst, imm=src)

    def mov(self, dst: int, src: int | tuple[str, int]) -> None:
        self.alu("mov", dst, src)

    def load(self, dst: int, base: int, off: int, size: int = 8) -> None:
        self._emit(_LDX | _MEM | _SIZES[size], dst, base, off)

    def store(self, base: int, off: int, src: int, size: int = 8) -> None:
        self._emit(_STX | _MEM | _SIZES[size], base, src, off)

    def store_imm(self, base: int, off: int, imm: int, size: int = 8) -> None:
        self._emit(_ST | _MEM | _SIZES[size], base, off=off, imm=imm)

    def atomic_add(self, base: int, off: int, src: int) -> None:
        """``*(u64 *)(base + off) += src``, atomically."""
        self._emit(_STX | _ATOMIC | _SIZES[8], base, src, off, 0x00)

    def load_imm64(self, dst: int, value: int) -> None:
        """``dst = value``, all 64 bits (an ALU immediate is 32 bits, sign-extended): two instruction slots."""
        lo, hi = (value & 0xFFFFFFFF), (value >> 32) & 0xFFFFFFFF
        self._emit(0x18, dst, imm=lo - (1 << 32) if lo >= 1 << 31 else lo)
        self._emit(0, imm=hi - (1 << 32) if hi >= 1 << 31 else hi)

    def map_fd(self, dst: int, bpf_map: Map) -> None:
        """Load the address of ``bpf_map`` (BPF_PSEUDO_MAP_FD) into ``dst``: two instruction slots."""
        self._emit(0x18, dst, 1, imm=bpf_map.fd)
        self._emit(0)

    def call(self, helper: int) -> None:
        self._emit(_JMP | 0x80, imm=helper)

    def jump(self, cond: str, dst: int, src: int | tuple[str, int], target: str) -> None:
        """Go to ``target`` when ``dst <cond> src`` (64-bit; unsigned, or signed for "s..."); "ja" always."""
        self._fixups.append((len(self._insns), target))
        if isinstance(src, tuple):
            self._emit(_JMP | _JUMPS[cond] | 0x08, dst, src[1])
        else:
            self._emit(_JMP | _JUMPS[cond], dst, imm=src)

    def exit(self) -> None:
        self._emit(_JMP | 0x90)

    def assemble(self) -> bytes:
        """The instructions, jumps resolved. Raises KeyError for an unknown label."""
        for at, target in self._fixups:
            self._insns[at][3] = self._labels[target] - at - 1
        return b"".join(struct.pack("<BBhi", c, (s << 4) | d, o, i) for c, d, s, o, i in self._insns)
