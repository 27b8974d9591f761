"""The pid namespace table the read counter's programs ask (vmcache.host.pidns); the kernel's side is
tests/kernels/nscheck.py (make test-kernels, on each kernel)."""

from __future__ import annotations

import os
import struct

import pytest

from vmcache.host.pidns import INIT_INO, SLOTS, TABLE, NoSlot, PidNs, kernel_dev


class _Array:
    """The one-entry table; ``rewrite`` is what another container's agent writes at our next update (it
    read the table before we wrote ours)."""

    def __init__(self, rewrite: list[bytes] | None = None) -> None:
        self.value = bytes(TABLE)
        self.rewrite = rewrite or []
        self.updates = 0

    def lookup(self, key: bytes) -> bytes | None:
        return self.value

    def update(self, key: bytes, value: bytes) -> None:
        assert len(value) == TABLE
        self.updates += 1
        self.value = self.rewrite.pop(0) if self.rewrite else value


class _Hash:
    def __init__(self, keys: list[bytes]) -> None:
        self._keys = keys

    def keys(self) -> list[bytes]:
        return list(self._keys)


def _pairs(*pairs: tuple[int, int]) -> bytes:
    return b"".join(struct.pack("=QQ", *p) for p in pairs).ljust(TABLE, b"\0")


def _held(table: _Array) -> list[tuple[int, int]]:
    return [p for i in range(SLOTS) if (p := struct.unpack_from("=QQ", table.value, 16 * i))[1]]


POD, OTHER = PidNs(4, 4026532179), PidNs(4, 4026532200)


def test_own_is_this_process_s_namespace_by_nsfs_device_and_inode() -> None:
    ns = PidNs.own()
    st = os.stat("/proc/self/ns/pid")
    assert (ns.dev, ns.ino) == (kernel_dev(st.st_dev), st.st_ino)
    assert kernel_dev(os.makedev(254, 3)) == (254 << 20) | 3


def test_the_host_s_first_namespace_needs_no_entry_and_others_join_once_from_the_front() -> None:
    table = _Array()
    host = PidNs(4, INIT_INO)
    host.claim(table)
    assert table.updates == 0 and host.first
    for ns in (POD, OTHER, POD):
        ns.claim(table)
    assert _held(table) == [(4, POD.ino), (4, OTHER.ino)] and table.updates == 2


def test_a_table_another_agent_rewrote_at_the_same_moment_is_written_again_with_both() -> None:
    table = _Array(rewrite=[_pairs((4, OTHER.ino))])  # our write lost: theirs, read before ours, wins
    POD.claim(table)
    assert _held(table) == [(4, OTHER.ino), (4, POD.ino)]


def test_a_full_table_is_an_error_that_says_so() -> None:
    table = _Array()
    for i in range(SLOTS):
        PidNs(4, 4026533000 + i).claim(table)
    with pytest.raises(NoSlot, match=f"{SLOTS} other"):
        POD.claim(table)


def test_a_namespace_leaves_the_table_only_when_no_qemu_of_it_is_counted_and_the_rest_stay_in_front() -> None:
    table = _Array()
    POD.claim(table)
    OTHER.claim(table)
    POD.release(table, _Hash([POD.qemu_key(7), OTHER.qemu_key(7)]))
    assert _held(table) == [(4, POD.ino), (4, OTHER.ino)]
    POD.release(table, _Hash([OTHER.qemu_key(7)]))
    assert table.value == _pairs((4, OTHER.ino))


def test_an_entry_s_owner_is_known_only_to_its_own_namespace() -> None:
    host = PidNs(4, INIT_INO)
    value = POD.owner(42)
    assert (POD.owns(value), host.owns(value)) == (42, None)
    assert POD.owns(bytes(12) + POD.owner(9) + bytes(4), 12) == 9
    assert POD.qemu_key(3) != host.qemu_key(3)  # the same pid in two namespaces: two QEMUs
