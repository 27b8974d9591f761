"""The host cap divided by benefit between real agents of real domains (issue 14).

Two opted-in domains whose budgets (20 MiB each) add up to more than the
host's pinned cap (24 MiB), started by the installed hook. "Guest" writes
are HMP ``qemu-io`` on their virtio disks: ``hot`` writes 20 MiB every
second, ``warm`` 12 MiB every third second. While both write, the cap goes
to hot's hotter bytes first; once hot goes idle, its grant falls and warm's
rises to its whole hot set. A sampler reads, every 0.2 s, the bytes the two
agents really hold locked (the pages their pins map, each once) and what
the ledger records: their sum never passes the cap.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("libvirt")

import libvirt

from vmcache.cli import main
from vmcache.host.ledger import Ledger

from tests.live.livelib import MiB, LiveEnv, agents_env, connect, wait_for

from tests.live.guestlib import guest_write, mapped
from vmcache.host.files import file_stem

pytestmark = pytest.mark.live

PREFIX = f"vmcache-test-share-{os.getpid()}-"
CAP = 24 * MiB


@pytest.fixture(scope="module")
def env(live_tmp: Path, hooked) -> Iterator[LiveEnv]:
    yield from agents_env(live_tmp, hooked, PREFIX, cap=CAP)


def pinned_bytes(pid: int, image: Path) -> int:
    """Bytes of ``image`` that agent ``pid`` maps (its pins are its only mappings of it, locked whole), each
    byte once: while a pin grows the agent locks the grown region before it unmaps the old one, so VmLck
    counts the bytes both map twice for a moment, though they are the same pages."""
    end, total = 0, 0
    for offset, length in mapped(pid, image):
        total += max(0, offset + length - max(offset, end))
        end = max(end, offset + length)
    return total


class Sampler(threading.Thread):
    """Every 0.2 s: the bytes the agents hold locked (the pages their pins map, each once) and the ledger's
    sum; the largest seen."""

    def __init__(self, env: LiveEnv, names: list[str]) -> None:
        super().__init__(daemon=True)
        self.env, self.names = env, names
        self.stop = threading.Event()
        self.max_locked = self.max_ledger = self.samples = 0

    def run(self) -> None:
        while not self.stop.wait(0.2):
            held = [(self.env.agent_pid(n), self.env.tmp / f"{file_stem(n)}.raw") for n in self.names]
            try:
                self.max_locked = max(self.max_locked, sum(pinned_bytes(p, image) for p, image in held if p))
            except FileNotFoundError:  # an agent ended between its pid and its maps
                continue
            try:
                ledger = json.loads((self.env.run / "ledger.json").read_text())["domains"]
            except (FileNotFoundError, ValueError):  # replaced between listing and reading
                continue
            self.max_ledger = max(self.max_ledger, sum(e["bytes"] for e in ledger.values()))
            self.samples += 1


class Writer(threading.Thread):
    """Once a second: ``hot`` writes 20 MiB while ``hot_busy``; ``warm`` 12 MiB every ``warm_every`` seconds.

    Its own libvirt connection, opened again when libvirtd restarts (other
    live tests on a shared host restart it); a second failure in a row is
    reported as ``error``.
    """

    def __init__(self, hot: str, warm: str) -> None:
        super().__init__(daemon=True)
        self.hot, self.warm = hot, warm
        self.hot_busy, self.warm_every = True, 3
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        tick, conn, failed = 0, connect(), False
        while not self.stop.wait(1.0):
            tick += 1
            try:
                if self.hot_busy:
                    guest_write(conn.lookupByName(self.hot), 0, 20 * MiB)
                if tick % self.warm_every == 0:
                    guest_write(conn.lookupByName(self.warm), 0, 12 * MiB, pattern=0xCD)
                failed = False
            except libvirt.libvirtError as err:
                if failed:
                    self.error = err
                    return
                failed, conn = True, connect()


def grant(env: LiveEnv, name: str) -> int:
    s = env.status(name)
    return s["granted_bytes"] if s else -1


def demand(env: LiveEnv, name: str) -> int:
    s = env.status(name)
    return s["demand_bytes"] if s else -1


def test_grants_follow_heat_never_pass_the_cap_and_an_idle_domain_gives_way(env: LiveEnv,
                                                                             capsys: pytest.CaptureFixture[str]) -> None:
    hot, warm = PREFIX + "hot", PREFIX + "warm"
    doms = {n: env.domain(n, budget="20M") for n in (hot, warm)}
    for name in doms:
        wait_for(lambda n=name: (s := env.status(n)) and s["state"] == "running", f"the agent of {name}")
    sampler, writer = Sampler(env, [hot, warm]), Writer(hot, warm)
    sampler.start()
    writer.start()
    try:
        # both write: the cap goes to hot's bytes, written every second, before warm's
        wait_for(lambda: env.pinned(hot) >= 18 * MiB and grant(env, hot) > grant(env, warm)
                 and demand(env, warm) > 0, "hot to hold its hot set and more of the cap than warm", timeout=90)
        hot_then, warm_then = grant(env, hot), grant(env, warm)
        split = Ledger(str(env.run / "ledger.json"), None).host_share().split  # one consistent snapshot
        assert split.cap == CAP and sum(split.grants.values()) <= CAP
        assert demand(env, hot) >= 18 * MiB
        assert main(["status", "--host-config", str(env.config)]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"host: pinned cap {CAP // MiB}MiB, held ") and "granted" in out
        # hot goes idle, warm writes every second: warm gets its whole hot set, hot gives way
        writer.hot_busy, writer.warm_every = False, 1
        wait_for(lambda: env.pinned(warm) >= 11 * MiB and grant(env, warm) > warm_then and grant(env, hot) < hot_then,
                 "the idle domain to give its share to the busy one", timeout=120)
        assert writer.error is None, writer.error
    finally:
        writer.stop.set()
        sampler.stop.set()
        writer.join(30)
        sampler.join(5)
    print(f"share_live: samples={sampler.samples} max_locked={sampler.max_locked} max_ledger={sampler.max_ledger} "
          f"cap={CAP} phase1 grants hot={hot_then} warm={warm_then} phase2 hot={grant(env, hot)} "
          f"warm={grant(env, warm)}")
    assert sampler.samples > 20
    assert sampler.max_locked <= CAP, f"locked {sampler.max_locked} > cap {CAP}"
    assert sampler.max_ledger <= CAP, f"ledger {sampler.max_ledger} > cap {CAP}"
    conn = connect()
    for name in doms:
        conn.lookupByName(name).destroy()
    for name in doms:
        wait_for(lambda n=name: env.agent_pid(n) is None, f"the agent of {name} to stop")
    share = json.loads((env.run / "share.json").read_text())
    assert not set(share["domains"]) & set(doms)  # both gave their entries back
