"""A VM under a memory limit (libvirt ``<memtune><hard_limit>``): its pins never take the room QEMU needs.

Pinned page cache pages cannot be reclaimed, and the guest's reads charge
them to QEMU's memory cgroup: under a hard limit, every pinned byte is one
QEMU's own memory cannot grow into, and a QEMU that grows into a limit the
pins fill is killed by the cgroup OOM killer (seen on this host: two VMs
under one limited parent, docs/reliability.md). The real agent, a real
libvirt domain, the limit set the operator's way (``virsh memtune
--hard-limit``, here through libvirt's API on the running domain).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

libvirt = pytest.importorskip("libvirt")

from vmcache.host.memcg import limits_of, margin, memory_cgroup  # noqa: E402

from tests.live.guestlib import guest_active, guest_write, read_until_pinned  # noqa: E402
from tests.live.livelib import GiB, LiveEnv, MiB, agents_env, qemu_pid, wait_for  # noqa: E402

pytestmark = pytest.mark.live

PREFIX = f"vmcache-test-memcg-{os.getpid()}-"
INTERVAL = 1.0
UNLIMITED_KIB = 9007199254740991  # VIR_DOMAIN_MEMORY_PARAM_UNLIMITED


@pytest.fixture(scope="module")
def env(live_tmp: Path, hooked) -> Iterator[LiveEnv]:
    # decay 0.98: the zone, written once and read a page at a time, stays hot for the whole test (no write may
    # grow QEMU under its limit)
    yield from agents_env(live_tmp, hooked, PREFIX, cap="256M", model={"decay": 0.98, "block_size": "1M"})


def hard_limit(dom, kib: int) -> None:
    dom.setMemoryParameters({libvirt.VIR_DOMAIN_MEMORY_HARD_LIMIT: kib}, libvirt.VIR_DOMAIN_AFFECT_LIVE)


ZONE = 48 * MiB


def cgroup_file(where: tuple[int, str], name: str) -> int:
    return int(Path(f"/sys/fs/cgroup/memory{where[1]}/{name}").read_text())


def stat(where: tuple[int, str]) -> dict[str, int]:
    text = Path(f"/sys/fs/cgroup/memory{where[1]}/memory.stat").read_text()
    return {key: int(value) for key, value in (line.split() for line in text.splitlines())}


def test_pins_leave_a_limited_vm_its_margin_and_come_back_when_the_limit_goes(env: LiveEnv) -> None:
    """Pins that hold the guest's pages, charged to QEMU: under ``fill: cached`` (the agent reads nothing) or an
    agent under QEMU's limits too. Elsewhere the agent reads its pins in itself (the test below)."""
    name = PREFIX + "lim"
    try:
        with env.config_override(fill="cached"):
            dom = env.domain(name, budget="64M", size=128 * MiB)
            wait_for(lambda: env.agent_pid(name), "the agent, started under fill: cached")
        qpid = qemu_pid(name)
        where = memory_cgroup(qpid)
        if where is None or where[0] != 1:
            pytest.skip(f"QEMU's memory cgroup is not on cgroup v1 here ({where})")
        assert limits_of(*where) == []  # no limit anywhere above QEMU yet
        with guest_active(dom):  # a guest that reads: an idle one's zone would cool (model/reads.py idle)
            # The guest writes its zone before any pin: its pages are charged to QEMU's cgroup, then locked there
            # once it reads them (the counted reads decide).
            guest_write(dom, 0, ZONE)
            read_until_pinned(dom, 0, ZONE, lambda: env.pinned(name), "the zone to be pinned", at_least=ZONE - 8 * MiB)
            pinned = env.pinned(name)
            if stat(where)["total_mapped_file"] < pinned - 8 * MiB:  # the agent maps what it locks
                pytest.skip(f"the pinned pages are not charged to QEMU's cgroup here ({stat(where)})")

            # The operator caps the VM: first far above its use, to read what it cannot give back (``held``), then
            # so that past it and the margin (64 MiB) 32 MiB are left - the pins are 16 MiB into the margin.
            hard_limit(dom, (cgroup_file(where, "memory.usage_in_bytes") + GiB) // 1024)
            (first,) = limits_of(*where)
            held = first.limit - margin(first.limit) - first.room  # usage less what the kernel could reclaim
            hard_limit(dom, (held - pinned + 96 * MiB) // 1024)
            (limit,) = limits_of(*where)
            assert margin(limit.limit) == 64 * MiB and -24 * MiB <= limit.room <= -8 * MiB, limit
            wait_for(lambda: limits_of(*where)[0].room >= 0, "pins to leave the margin", timeout=10 * INTERVAL + 10)
            log = env.agent_log(name)
            assert re.search(r"pin\.remove start=\d+ length=\d+ reason=cgroup", log), log[-3000:]
            # the zone (one region) gave back its tail, not all of it: the rest of the room still holds its head
            assert 16 * MiB <= env.pinned(name) < ZONE, (env.pinned(name), limits_of(*where))
            time.sleep(3 * INTERVAL)  # and they stay out of it, cycle after cycle
            assert limits_of(*where)[0].room >= 0, (limits_of(*where), env.pinned(name))

            hard_limit(dom, UNLIMITED_KIB)  # the limit goes, the guest uses its zone again: it is pinned again
            assert limits_of(*where) == []
            guest_write(dom, 0, ZONE)
            read_until_pinned(dom, 0, ZONE, lambda: env.pinned(name), "the zone pinned again once the limit is gone",
                              timeout=10 * INTERVAL + 10, at_least=ZONE - 8 * MiB)
            assert qemu_pid(name) == qpid and dom.isActive()  # QEMU never killed
    finally:
        env.cleanup()


def test_an_operator_can_lower_a_pinned_vm_s_hard_limit_as_far_as_without_vmcache(env: LiveEnv) -> None:
    """``virsh memtune --hard-limit`` below what a VM holds: the kernel meets it by dropping page cache, but not a
    locked page. Pins charged to QEMU made cgroup v1 refuse the limit (EBUSY; v2 would OOM-kill QEMU). Under a
    limit the agent does not share, the agent reads what it pins itself, so that the pins are charged to it: those
    made before the limit (read again), and those made under it."""
    name = PREFIX + "lower"
    try:
        dom = env.domain(name, budget="64M", size=128 * MiB)
        qpid = qemu_pid(name)
        where = memory_cgroup(qpid)
        if where is None or where[0] != 1:
            pytest.skip(f"QEMU's memory cgroup is not on cgroup v1 here ({where})")
        with guest_active(dom):
            guest_write(dom, 0, ZONE)  # no limit yet: the pins hold the guest's pages, charged to QEMU
            read_until_pinned(dom, 0, ZONE, lambda: env.pinned(name), "the zone to be pinned", at_least=ZONE - 8 * MiB)
            wait_for(lambda: stat(where)["total_mapped_file"] >= ZONE - 8 * MiB, "the pins charged to QEMU")

            hard_limit(dom, (cgroup_file(where, "memory.usage_in_bytes") + GiB) // 1024)
            wait_for(lambda: "pin.recharge" in env.agent_log(name), "the pins read in by the agent",
                     timeout=10 * INTERVAL + 10)
            wait_for(lambda: stat(where)["total_mapped_file"] < 4 * MiB, "the pins charged to the agent")
            pinned = env.pinned(name)
            guest_write(dom, ZONE, 16 * MiB)  # pinned under the limit: read in by the agent at once
            read_until_pinned(dom, ZONE, 16 * MiB, lambda: env.pinned(name), "the second zone to be pinned",
                              at_least=pinned + 8 * MiB)
            assert stat(where)["total_mapped_file"] < 4 * MiB, stat(where)

            lower_past_the_pins(dom, where)
            assert qemu_pid(name) == qpid and dom.isActive()
    finally:
        env.cleanup()


def lower_past_the_pins(dom, where: tuple[int, str]) -> None:
    """Lower the limit as far as the kernel could meet without vmcache - to QEMU's cgroup's use less all its
    page cache (no swap here: anonymous memory stays) - and check it took."""
    target = cgroup_file(where, "memory.usage_in_bytes") - stat(where)["total_cache"] + 16 * MiB
    hard_limit(dom, target // 1024)  # libvirtError (EBUSY) where the pins are charged to QEMU
    assert limits_of(*where)[0].limit == target // 1024 * 1024
