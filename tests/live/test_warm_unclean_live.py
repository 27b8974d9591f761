"""Warm start after a stop nobody saved at: the agent and QEMU both killed (``kill -9``), as a host's
power loss leaves them. The next start still finds a set no older than ``hotset_interval`` - the
persistent definition's and the host's copy, saved every interval - and pins it again before the
guest reads.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

libvirt = pytest.importorskip("libvirt")

from vmcache.host.hotstore import HotStore  # noqa: E402
from vmcache.settings.hotset import HotSet  # noqa: E402

from tests.live.livelib import LiveEnv, agents_env, qemu_pid, wait_for  # noqa: E402
from tests.live.test_warm_live import agent_gone, first_run, wait_mapped  # noqa: E402
from tests.pagecache_util import drop  # noqa: E402

pytestmark = pytest.mark.live

PREFIX = f"vmcache-test-warmkill-{os.getpid()}-"
EVERY = 3.0   # hotset_interval, s


@pytest.fixture(scope="module")
def env(live_tmp: Path, hooked) -> Iterator[LiveEnv]:
    yield from agents_env(live_tmp, hooked, PREFIX, hotset_interval=f"{EVERY:g}s", model={"block_size": "1M"})


def test_after_a_stop_nobody_saved_at_the_next_start_warms_from_a_set_no_older_than_hotset_interval(
        env: LiveEnv) -> None:
    name = PREFIX + "power"
    dom, image, record = first_run(env, name)
    store = HotStore(str(env.tmp / "hotsets"))
    uuid = dom.UUIDString()
    def saved() -> HotSet | None:
        found = store.load(uuid)
        disk = found.disk("vda") if found else None
        return found if disk is not None and disk.bytes >= record.bytes else None

    copy = wait_for(saved, "a periodic save to the host's copy", timeout=4 * EVERY)
    agent, qemu = env.agent_pid(name), qemu_pid(name)
    assert agent
    os.kill(agent, signal.SIGKILL)    # first: it must not save as QEMU goes
    killed = time.time()
    os.kill(qemu, signal.SIGKILL)
    wait_for(lambda: not dom.isActive(), "libvirt to see QEMU gone")
    agent_gone(env, name)
    drop(image)
    dom.createWithFlags(libvirt.VIR_DOMAIN_START_PAUSED)
    pid = wait_for(lambda: (p := env.agent_pid(name)) and p != agent and p, "the new run's agent")
    loaded = wait_for(lambda: re.search(r"hotset\.loaded disks=1 saved=(\d+) definition=(\w+)", env.agent_log(name)),
                      "the new agent to load a saved set")
    # (the new run's live definition starts as a copy of the persistent one: a tie between them goes to it)
    assert killed - int(loaded.group(1)) <= EVERY + 2, (killed, loaded.group(0))   # an interval and a cycle
    assert int(loaded.group(1)) >= copy.saved
    wait_mapped(pid, image, record.regions, "the saved regions to be locked again", timeout=30)
    dom.destroy()
    agent_gone(env, name)
    dom.undefine()
