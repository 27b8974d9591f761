"""The host's warm-up budget on real agents: two domains restoring saved hot sets at once share one
``warm_rate``, as after a host reboot, instead of each reading at it.

Two persistent domains on one file system, each with a 14 MiB saved region none of which is cached,
started paused within a moment; ``warm_rate`` 4 MiB/s (the host's), ``prefetch_rate`` 256 KiB/s (each
disk's own), 1 s cycles. A sampler reads, every 50 ms, the bytes each agent maps of its image (its
pins, each byte once): together they never run ahead of the host's budget (one burst of an interval's
worth, then 4 MiB/s) and each disk's own prefetch; each agent alone at 4 MiB/s would take twice that.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

libvirt = pytest.importorskip("libvirt")

from vmcache.host.virtdomain import Affect, VirtDomain  # noqa: E402
from vmcache.model.region import Region  # noqa: E402
from vmcache.settings.hotset import HotSet  # noqa: E402

from tests.live.guestlib import mapped  # noqa: E402
from tests.live.livelib import MiB, LiveEnv, agents_env, wait_for  # noqa: E402
from tests.live.test_warm_live import agent_gone, first_run  # noqa: E402
from tests.pagecache_util import drop  # noqa: E402

pytestmark = pytest.mark.live

PREFIX = f"vmcache-test-warmshare-{os.getpid()}-"
WARM, OWN, SET = 4 * MiB, 256 << 10, 14 * MiB
START = 20 * MiB   # away from what the first runs pinned (8-12 and 40-44 MiB): not cached


@pytest.fixture(scope="module")
def env(live_tmp: Path, hooked) -> Iterator[LiveEnv]:
    yield from agents_env(live_tmp, hooked, PREFIX, hotset_interval="2s", prefetch_rate="256K", warm_rate="4M",
                          model={"block_size": "1M"})


def held(pid: int, image: Path) -> int:
    """Bytes of ``image`` agent ``pid`` maps, each once."""
    end = total = 0
    for offset, length in mapped(pid, image):
        total += max(0, offset + length - max(offset, end))
        end = max(end, offset + length)
    return total


def test_two_domains_restoring_at_once_share_the_hosts_warm_rate(env: LiveEnv) -> None:
    names = [PREFIX + "a", PREFIX + "b"]
    doms: dict[str, tuple[Any, Path]] = {}
    for name in names:
        dom, image, record = first_run(env, name)
        dom.destroy()
        agent_gone(env, name)
        VirtDomain(env.conn, name).set_hotset(
            HotSet(int(time.time()), (replace(record, regions=(Region(START, SET, 14.0),)),)), Affect.CONFIG)
        drop(image)
        doms[name] = (dom, image)
    samples: list[tuple[float, list[int]]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            pids = [(env.agent_pid(n), doms[n][1]) for n in names]
            try:
                each = [held(pid, image) if pid else 0 for pid, image in pids]
            except FileNotFoundError:   # an agent between its pidfile and its maps
                continue
            samples.append((time.monotonic(), each))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    for name in names:
        doms[name][0].createWithFlags(libvirt.VIR_DOMAIN_START_PAUSED)
    sampler.start()
    try:
        for i, name in enumerate(names):
            wait_for(lambda n=name: "warm.done" in env.agent_log(n), f"{name}'s agent to restore its set",
                     timeout=60)
            # the sampler's next reading after the last pin, however late a loaded host runs it
            wait_for(lambda i=i: any(each[i] >= SET for _t, each in samples), f"{name}'s set seen locked whole",
                     timeout=10)
    finally:
        stop.set()
        sampler.join(5)
    # from the first pin on: one burst (an interval's worth of the host's rate) and the rate since, and each
    # disk's own prefetch (its first cycle's worth and its rate); a block of slack for each disk's chunk
    first = next(at for at, each in samples if sum(each))
    for at, each in samples:
        allowed = WARM * (1 + (at - first)) + 2 * OWN * (1 + (at - first)) + 2 * MiB
        assert sum(each) <= allowed, (round(at - first, 2), each, allowed)
    for name in names:
        assert re.search(rf"warm\.done image=\S+ restored={SET} ", env.agent_log(name)), env.agent_log(name)[-2000:]
    for name in names:
        doms[name][0].destroy()
        agent_gone(env, name)
        doms[name][0].undefine()
