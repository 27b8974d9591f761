"""The pid namespace slots the read counter's programs ask (vmcache.host.pidns); the kernel's side is
tests/kernels/nscheck.py (make test-kernels, on each kernel)."""

from __future__ import annotations

import os
import struct

import pytest

from vmcache.host.pidns import INIT_INO, SLOTS, NoSlot, PidNs, kernel_dev


class _Array:
    """An array map: every key there, zeroed; ``steal`` writes another value at the first update of a slot
    (another container's agent taking the same free slot at the same moment)."""

    def __init__(self, steal: bytes | None = None) -> None:
        self.values = {struct.pack("=I", i): bytes(16) for i in range(SLOTS)}
        self.steal = steal

    def lookup(self, key: bytes) -> bytes | None:
        return self.values[key]

    def update(self, key: bytes, value: bytes) -> None:
        self.values[key] = value
        if self.steal is not None:
            self.values[key], self.steal = self.steal, None


class _Hash:
    def __init__(self, keys: list[bytes]) -> None:
        self._keys = keys

    def keys(self) -> list[bytes]:
        return list(self._keys)


def _held(slots: _Array) -> list[tuple[int, int]]:
    return [struct.unpack("=QQ", slots.values[struct.pack("=I", i)]) for i in range(SLOTS)]


def test_own_is_this_process_s_namespace_by_nsfs_device_and_inode() -> None:
    ns = PidNs.own()
    st = os.stat("/proc/self/ns/pid")
    assert (ns.dev, ns.ino) == (kernel_dev(st.st_dev), st.st_ino)
    assert kernel_dev(os.makedev(254, 3)) == (254 << 20) | 3


def test_a_namespace_takes_the_first_free_slot_once_and_keeps_it() -> None:
    slots = _Array()
    host, pod = PidNs(4, INIT_INO), PidNs(4, 4026532179)
    assert (host.claim(slots), pod.claim(slots), host.claim(slots), pod.claim(slots)) == (0, 1, 0, 1)
    assert _held(slots)[:3] == [(4, INIT_INO), (4, 4026532179), (0, 0)]


def test_a_slot_another_agent_wrote_at_the_same_moment_is_left_to_it() -> None:
    theirs = struct.pack("=QQ", 4, 4026532200)
    slots = _Array(steal=theirs)
    assert PidNs(4, 4026532179).claim(slots) == 1
    assert _held(slots)[:2] == [(4, 4026532200), (4, 4026532179)]


def test_no_free_slot_is_an_error_that_says_so() -> None:
    slots = _Array()
    for i in range(SLOTS):
        PidNs(4, 4026533000 + i).claim(slots)
    with pytest.raises(NoSlot, match=f"all {SLOTS}"):
        PidNs(4, 4026532179).claim(slots)


def test_a_slot_is_freed_only_when_no_qemu_of_its_namespace_is_counted() -> None:
    pod, other = PidNs(4, 4026532179), PidNs(4, 4026532200)
    slots = _Array()
    pod.claim(slots), other.claim(slots)
    pod.release(slots, _Hash([pod.qemu_key(7), other.qemu_key(7)]))
    assert _held(slots)[:2] == [(4, 4026532179), (4, 4026532200)]
    pod.release(slots, _Hash([other.qemu_key(7)]))
    assert _held(slots)[:2] == [(0, 0), (4, 4026532200)]


def test_an_entry_s_owner_is_known_only_to_its_own_namespace() -> None:
    pod, host = PidNs(4, 4026532179), PidNs(4, INIT_INO)
    value = pod.owner(42)
    assert (pod.owns(value), host.owns(value)) == (42, None)
    assert pod.owns(bytes(12) + pod.owner(9) + bytes(4), 12) == 9
    assert pod.qemu_key(3) != host.qemu_key(3)  # the same pid in two namespaces: two QEMUs
