"""The agent beside libvirt's jobs of its domain: it never queues a QMP command behind one.

A QMP command sent through libvirt while libvirt runs a job of the domain
waits for that job, up to 30 s, and some jobs wait for the agent in turn:
a snapshot revert's job runs the hook that fences the old run
(vmcache.host.rungate), which waits for the old agent's command in flight
- the revert was held 35 s, until the fence killed the agent. So the agent
sends a command only while the domain has no job, after waiting at most
2 s for one to end (vmcache.service.domainlink). Here another client holds
the domain's monitor for 6 s with one slow read (HMP ``qemu-io`` of an
image on a delay device whose every miss costs 6 s): the agent's cycles go
on meanwhile, its bitmap read defers, and no write is lost.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

libvirt = pytest.importorskip("libvirt")

from bench.e2e_host import Device, mount_delay, unmount_delay  # noqa: E402
from tests.live.guestlib import guest_read, guest_write  # noqa: E402
from tests.live.livelib import LiveEnv, MiB, agents_env, scrape, wait_for  # noqa: E402

pytestmark = pytest.mark.live

PREFIX = f"vmcache-test-jobs-{os.getpid()}-"
MISS_S = 6.0


@pytest.fixture(scope="module")
def env(live_tmp: Path, hooked) -> Iterator[LiveEnv]:
    yield from agents_env(live_tmp, hooked, PREFIX)


@pytest.fixture
def slow_image(env: LiveEnv) -> Iterator[Path]:
    """A 64 MiB raw image whose every read the page cache misses costs MISS_S seconds; its first page cached
    (the agent reads it once to learn how the kernel names the image)."""
    if not Path("/dev/fuse").exists():
        pytest.skip("needs /dev/fuse")
    backing = env.tmp / "slow-backing"
    backing.mkdir()
    with open(backing / "slow.raw", "wb") as f:
        f.truncate(64 * MiB)
    mount = env.tmp / "slow"
    proc = mount_delay(Device("slow", read_ms=MISS_S * 1000, nominal=f"{MISS_S:g} s"), backing, mount,
                       env.tmp / "slow-stats.json")
    try:
        fd = os.open(mount / "slow.raw", os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            os.pread(fd, 4096, 0)
        finally:
            os.close(fd)
        yield mount / "slow.raw"
    finally:
        env.cleanup()
        unmount_delay(proc, mount)


def dirtied(env: LiveEnv, name: str) -> float:
    return scrape(env.status(name)["metrics_url"], "vmcache_guest_dirtied_bytes_total")


def cycles(env: LiveEnv, name: str) -> int:
    s = env.status(name)
    return s["disks"][0]["cycles"] if s and s["disks"] else 0


def test_a_job_holding_the_monitor_defers_the_agents_commands_and_loses_no_write(env: LiveEnv,
                                                                                 slow_image: Path) -> None:
    name = PREFIX + "held"
    dom = env.domain(name, image=slow_image)
    wait_for(lambda: cycles(env, name) >= 2, "the agent's first cycles")
    base = dirtied(env, name)
    guest_write(dom, 40 * MiB, 2 * MiB)   # written just before the monitor is taken: read only after it
    held: dict[str, float] = {}

    def hold_monitor() -> None:   # one read the page cache misses: the monitor answers nobody for MISS_S
        held["from"] = time.monotonic()
        guest_read(dom, 32 * MiB, 4096)
        held["to"] = time.monotonic()

    holder = threading.Thread(target=hold_monitor)
    before = cycles(env, name)
    holder.start()
    seen = []
    while holder.is_alive():
        seen.append(cycles(env, name))
        time.sleep(0.2)
    holder.join()
    assert held["to"] - held["from"] >= MISS_S * 0.9, held
    # 1 s cycles whose commands wait 2 s for the job: at least two cycles while it lasted (one queued behind
    # the job would end only with it)
    assert max(seen) - before >= 2, (before, seen)
    assert "tracker.deferred" in env.agent_log(name) and "busy with a job" in env.agent_log(name)
    wait_for(lambda: dirtied(env, name) >= base + 2 * MiB, "the agent to read the write it deferred")
    settled = cycles(env, name)
    wait_for(lambda: cycles(env, name) >= settled + 2, "two more cycles")
    assert dirtied(env, name) == base + 2 * MiB
    log = env.agent_log(name)
    assert "Traceback" not in log and "cycle_failed" not in log and "read_failed" not in log, log[-3000:]
