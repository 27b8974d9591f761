"""Warm start where the guest's counted reads decide (``read_model: counted``), on a real libvirt domain.

A set restored by the next agent is held as a pinned one until the guest reads it, not let go at
``decay`` within a few cycles: a slow boot reads its hot set late. The domain is persistent, TCG,
started paused; "guest" reads are HMP ``qemu-io`` through the virtio device, which QEMU performs on
the image, so the kernel's read counter counts them as the guest's.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

libvirt = pytest.importorskip("libvirt")

from tests.live.guestlib import read_until_pinned  # noqa: E402
from tests.live.livelib import MiB, LiveEnv, agents_env, wait_for  # noqa: E402
from tests.live.test_warm_live import agent_gone, stop_start, wait_mapped, wait_saved  # noqa: E402

pytestmark = pytest.mark.live

PREFIX = f"vmcache-test-warmc-{os.getpid()}-"
ZONE = (8 * MiB, 4 * MiB)


@pytest.fixture(scope="module")
def env(live_tmp: Path, hooked) -> Iterator[LiveEnv]:
    yield from agents_env(live_tmp, hooked, PREFIX, hotset_interval="2s", read_model="counted")


def test_a_restored_set_the_guest_has_not_read_yet_stays_pinned(env: LiveEnv) -> None:
    name = PREFIX + "slow-boot"
    image = env.disk(name, 64 * MiB)
    dom = env.domain(name, image=image, persistent=True)
    wait_for(lambda: (s := env.status(name)) and s["state"] == "running", "the agent's first cycle")
    assert "reads.counted" in env.agent_log(name)  # the reads are counted: the exact path decides

    read_until_pinned(dom, *ZONE, lambda: env.pinned(name), "the zone the guest keeps reading to be pinned")
    record = wait_saved(env, name, ZONE[1])
    dom = stop_start(env, name, dom, image)
    pid = wait_for(lambda: env.agent_pid(name), "the hook to start the new agent")
    wait_mapped(pid, image, record.regions, "the saved regions to be locked again")
    wait_for(lambda: (s := env.status(name)) and s["disks"][0]["warm_restored_bytes"] == record.bytes,
             "the status to show the set restored")
    # The guest is paused and reads nothing. At these agents' decay (0.5 a 1 s cycle) an unread block's
    # heat of 1 is under threshold / keep_factor in 4 cycles; held at pinned_decay (0.98) it lasts ~2 min.
    time.sleep(20)
    assert env.pinned(name) == record.bytes, env.agent_log(name)[-3000:]
    dom.destroy()
    agent_gone(env, name)
    dom.undefine()
