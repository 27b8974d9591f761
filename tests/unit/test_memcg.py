"""host/memcg.py: the limited memory cgroups pins are charged to, on a cgroup tree of the test's own (v1 and v2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vmcache.errors import HostError
from vmcache.host.memcg import MARGIN_MIN, UNLIMITED_V1, CgroupLimit, MemcgRoom, limits_of, margin, memory_cgroup

MiB = 1 << 20


def group(root: Path, path: str, files: dict[str, str]) -> None:
    directory = root / path.strip("/")
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name).write_text(text)


def v1_group(root: Path, path: str, *, limit: int, usage: int, inactive: int = 0, active: int = 0, mapped: int = 0,
             unevictable: int = 0, refaulted: int = 0) -> None:
    group(root, path, {"memory.limit_in_bytes": f"{limit}\n", "memory.usage_in_bytes": f"{usage}\n",
                       "memory.stat": f"cache 0\nrss 0\ntotal_inactive_file {inactive}\ntotal_active_file {active}\n"
                                      f"total_mapped_file {mapped}\ntotal_unevictable {unevictable}\n"
                                      f"workingset_refault_file 1\ntotal_workingset_refault_file {refaulted}\n"})


def v2_group(root: Path, path: str, *, limit: str, current: int, inactive: int = 0, mapped: int = 0,
             unevictable: int = 0, refaulted: int = 0) -> None:
    group(root, path, {"memory.max": f"{limit}\n", "memory.current": f"{current}\n",
                       "memory.stat": f"anon 5\nfile 7\ninactive_file {inactive}\nactive_file 0\n"
                                      f"file_mapped {mapped}\nunevictable {unevictable}\n"
                                      f"workingset_refault_file {refaulted}\n"})


def proc_cgroup(proc: Path, pid: int, text: str) -> None:
    (proc / str(pid)).mkdir(parents=True)
    (proc / str(pid) / "cgroup").write_text(text)


def test_the_memory_line_decides_the_version(tmp_path: Path) -> None:
    proc_cgroup(tmp_path, 1, "12:pids:/a\n4:memory:/machine/qemu-1.scope\n1:name=systemd:/x\n0::/x\n")
    proc_cgroup(tmp_path, 2, "0::/machine.slice/machine-qemu\\x2d1.scope\n")
    proc_cgroup(tmp_path, 3, "4:cpu,memory:/bench/vm2\n")
    assert memory_cgroup(1, proc=str(tmp_path)) == (1, "/machine/qemu-1.scope")
    assert memory_cgroup(2, proc=str(tmp_path)) == (2, "/machine.slice/machine-qemu\\x2d1.scope")
    assert memory_cgroup(3, proc=str(tmp_path)) == (1, "/bench/vm2")
    assert memory_cgroup(4, proc=str(tmp_path)) is None  # gone


def test_every_limited_ancestor_counts_and_unlimited_ones_do_not(tmp_path: Path) -> None:
    v1_group(tmp_path, "/bench", limit=1000 * MiB, usage=900 * MiB, inactive=10 * MiB, active=5 * MiB)
    v1_group(tmp_path, "/bench/vm2", limit=UNLIMITED_V1 + 4096, usage=450 * MiB)
    found = limits_of(1, "/bench/vm2", v1_root=str(tmp_path))
    assert found == [CgroupLimit("/bench", 1000 * MiB, 900 * MiB, 15 * MiB, 15 * MiB)]
    # 1000 - 900 + 15, less an eighth of the limit (125 MiB): already 10 MiB into the margin
    assert found[0].room == -10 * MiB
    v2_group(tmp_path, "/m.slice", limit="max", current=1)
    v2_group(tmp_path, "/m.slice/vm", limit=str(2048 * MiB), current=1024 * MiB, inactive=100 * MiB)
    assert limits_of(2, "/m.slice/vm", v2_root=str(tmp_path)) == [
        CgroupLimit("/m.slice/vm", 2048 * MiB, 1024 * MiB, 100 * MiB, 100 * MiB)]
    assert limits_of(2, "/missing/vm", v2_root=str(tmp_path)) == []  # unreadable: skipped


def test_locked_pages_still_on_the_file_lists_are_not_counted_as_reclaimable(tmp_path: Path) -> None:
    # 48 MiB just locked by a pin (mapped, still on the active list), 2 MiB of it culled to the unevictable
    # list, 10 MiB of cache nobody maps: 10 MiB reclaimable (46 + 10 on the lists, 48 - 2 of them mapped)
    v1_group(tmp_path, "/vm", limit=512 * MiB, usage=300 * MiB, inactive=10 * MiB, active=46 * MiB, mapped=48 * MiB,
             unevictable=2 * MiB)
    assert limits_of(1, "/vm", v1_root=str(tmp_path))[0].reclaimable == 10 * MiB
    v2_group(tmp_path, "/vm2", limit=str(512 * MiB), current=300 * MiB, inactive=1 * MiB, mapped=200 * MiB,
             unevictable=200 * MiB)  # every pin culled: the lists hold what is reclaimable
    assert limits_of(2, "/vm2", v2_root=str(tmp_path))[0].reclaimable == 1 * MiB


def test_the_margin_is_an_eighth_of_the_limit_and_never_under_64_mib() -> None:
    assert margin(100 * MiB) == MARGIN_MIN == 64 * MiB
    assert margin(4096 * MiB) == 512 * MiB


@pytest.mark.parametrize("qemu_room, agent_room, expected", [(300, 50, 50), (20, 500, 20)])
def test_the_tightest_cgroup_of_qemu_and_the_agent_gives_the_room(tmp_path: Path, qemu_room: int, agent_room: int,
                                                                   expected: int) -> None:
    proc, root = tmp_path / "proc", tmp_path / "memory"
    proc_cgroup(proc, 10, "4:memory:/machine/vm\n")
    proc_cgroup(proc, 20, "4:memory:/system/agent\n")
    for path, room in (("/machine/vm", qemu_room), ("/system/agent", agent_room)):
        limit = 1024 * MiB  # margin 128 MiB
        v1_group(root, path, limit=limit, usage=limit - (room + 128) * MiB)
    rooms = MemcgRoom(lambda: (10, 20, None), proc=str(proc), v1_root=str(root))
    assert rooms.room() == expected * MiB
    assert MemcgRoom(lambda: (99,), proc=str(proc), v1_root=str(root)).room() is None  # gone: no limit known


def test_qemu_is_apart_under_a_limit_the_agent_does_not_share_and_then_only_the_agent_s_room_counts(
        tmp_path: Path) -> None:
    proc, root = tmp_path / "proc", tmp_path / "memory"
    proc_cgroup(proc, 10, "4:memory:/machine/vm\n")          # QEMU, under a limited parent and its own limit
    proc_cgroup(proc, 20, "4:memory:/machine/agent\n")       # an agent under the parent only
    proc_cgroup(proc, 30, "4:memory:/system/agent\n")        # an agent under no limit
    proc_cgroup(proc, 40, "4:memory:/machine/vm\n")          # an agent in QEMU's own cgroup (the bench's layout)
    limit = 1024 * MiB  # margin 128 MiB
    v1_group(root, "/machine", limit=4 * limit, usage=2 * limit)
    v1_group(root, "/machine/vm", limit=limit, usage=limit - (20 + 128) * MiB)   # room 20 MiB
    v1_group(root, "/machine/agent", limit=UNLIMITED_V1, usage=0)
    v1_group(root, "/system/agent", limit=UNLIMITED_V1, usage=0)

    def rooms(*pids: int | None) -> MemcgRoom:
        return MemcgRoom(lambda: pids, proc=str(proc), v1_root=str(root))

    assert rooms(10, 20).apart() and rooms(10, 30).apart()
    assert not rooms(10, 40).apart()                           # every limit above QEMU is the agent's too
    assert not rooms(None, 30).apart() and not rooms(99, 30).apart()  # QEMU gone
    assert rooms(10, 30).room() == 20 * MiB                    # QEMU's limit, while pins are charged to it
    assert rooms(10, 30).room(apart=True) is None              # the agent's: no limit
    assert rooms(10, 20).room(apart=True) == 4 * limit - 2 * limit - 512 * MiB  # the parent: the agent's too


def test_the_pressure_is_qemus_tightest_limit_s_refaults_and_cache_or_else_the_host_s(tmp_path: Path) -> None:
    proc, v1, v2 = tmp_path / "proc", tmp_path / "v1", tmp_path / "v2"
    proc_cgroup(proc, 10, "4:memory:/bench/vm\n")
    proc_cgroup(proc, 11, "0::/m.slice/vm\n")
    proc_cgroup(proc, 12, "4:memory:/free\n")
    v1_group(v1, "/bench", limit=1000 * MiB, usage=900 * MiB, inactive=10 * MiB, active=5 * MiB, refaulted=700)
    v1_group(v1, "/bench/vm", limit=UNLIMITED_V1, usage=1, refaulted=9)
    v2_group(v2, "/m.slice/vm", limit=str(512 * MiB), current=300 * MiB, inactive=64 * MiB, refaulted=33)
    (proc / "vmstat").write_text("nr_free_pages 1\nworkingset_refault_file 4242\n")
    (proc / "meminfo").write_text("MemTotal: 4096 kB\nMemFree: 1024 kB\nMemAvailable: 2048 kB\n"
                                  "Active(file): 100 kB\nInactive(file): 28 kB\n")

    def room(pid: int) -> MemcgRoom:
        return MemcgRoom(lambda: (pid, 99), proc=str(proc), v1_root=str(v1), v2_root=str(v2))

    assert room(10).pressure() == (700, 15 * MiB)        # the limited parent's subtree (v1 total_)
    assert room(11).pressure() == (33, 64 * MiB)
    assert room(12).pressure() == (4242, 128 * 1024)     # no limit above QEMU: the host's page cache
    (proc / "vmstat").unlink()
    with pytest.raises(HostError):
        room(12).pressure()
