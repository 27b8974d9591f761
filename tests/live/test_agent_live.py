"""The real agent, started by the installed hook, on real libvirt domains.

The product path end to end: libvirtd runs the installed hook, the hook's
launcher starts ``vmcache agent``, the agent tracks the guest's writes with
a dirty bitmap through libvirt, pins, and reports. Domains are transient,
TCG, started paused: "guest" writes are HMP ``qemu-io`` on the virtio disk,
which QEMU performs exactly as the guest's own. Everything is removed at
the end, even on failure.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

libvirt = pytest.importorskip("libvirt")

from vmcache.cli import main  # noqa: E402
from vmcache.host.files import file_stem  # noqa: E402
from vmcache.host.pagecache import scan_residency  # noqa: E402
from vmcache.host.virtdomain import Affect, VirtDomain  # noqa: E402

from tests.live.livelib import MiB, LiveEnv, agents_env, scrape, wait_for  # noqa: E402

from tests.live.guestlib import guest_read, guest_write, leftovers, write_until_pinned  # noqa: E402
from tests.pagecache_util import drop, locked_pages, vmlck  # noqa: E402

pytestmark = pytest.mark.live

PREFIX = f"vmcache-test-agent-{os.getpid()}-"
CAP = 24 * MiB


@pytest.fixture(scope="module")
def env(live_tmp: Path, hooked) -> Iterator[LiveEnv]:
    yield from agents_env(live_tmp, hooked, PREFIX, cap=CAP)


def test_hook_starts_the_agent_which_tracks_writes_pins_and_stops_with_the_domain(env: LiveEnv) -> None:
    name = PREFIX + "main"
    dom = env.domain(name, budget="16M")
    pid = wait_for(lambda: env.agent_pid(name), "the hook to start the agent")
    wait_for(lambda: (s := env.status(name)) and s["state"] == "running", "the agent's first cycle")
    status = env.status(name)
    assert [(d["target"], d["cache"], d["eligible"]) for d in status["disks"]] == [("vda", "writethrough", True)]
    assert wait_for(lambda: leftovers(dom)["bitmaps"], "the agent's dirty bitmap in QEMU")

    write_until_pinned(dom, 8 * MiB, 4 * MiB, lambda: env.pinned(name), "the written region to be pinned")
    status = env.status(name)
    assert status["disks"][0]["pinned_bytes"] <= 16 * MiB
    metrics = wait_for(lambda: scrape(status["metrics_url"], "vmcache_guest_dirtied_bytes_total"), "metrics")
    assert metrics >= 4 * MiB
    locked = vmlck(pid)
    assert 4 * MiB <= locked <= 17 * MiB
    png = env.tmp / "heat.png"
    assert main(["heatmap", name, "vda", "-o", str(png), "--host-config", str(env.config)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    js = env.tmp / "heat.json"
    assert main(["heatmap", name, "-o", str(js), "--json", "--host-config", str(env.config)]) == 0
    assert json.loads(js.read_text())["disk"] == "vda"

    dom.destroy()
    wait_for(lambda: env.agent_pid(name) is None, "the agent to exit after virsh destroy")
    assert env.status(name) is None
    assert not list((env.tmp / "run" / "prometheus").glob("*.json"))
    ledger = json.loads((env.tmp / "run" / "ledger.json").read_text())
    assert name not in json.dumps(ledger)


def test_disable_stops_the_agent_and_leaves_nothing_in_qemu(env: LiveEnv, capsys) -> None:
    name = PREFIX + "off"
    dom = env.domain(name, budget=None)
    time.sleep(1)
    assert env.agent_pid(name) is None  # no metadata: no agent
    assert main(["enable", name, "--budget", "8M", "--live", "--host-config", str(env.config)]) == 0
    wait_for(lambda: (s := env.status(name)) and s["state"] == "running", "vmcache enable to start an agent")
    write_until_pinned(dom, 0, 2 * MiB, lambda: env.pinned(name))
    assert leftovers(dom)["bitmaps"]

    assert main(["disable", name, "--live", "--host-config", str(env.config)]) == 0
    wait_for(lambda: env.agent_pid(name) is None, "the agent to exit once disabled")
    assert leftovers(dom) == {"bitmaps": [], "nodes": [], "exports": []}
    nbd = env.tmp / "run" / "nbd"
    assert not (list(nbd.rglob("*")) if nbd.exists() else []), list(nbd.rglob("*"))
    # no pidfile (the lock file) nor status file of it left in the agents directory
    stem = file_stem(name)
    assert not [p.name for p in env.agents.iterdir() if p.stem == stem], list(env.agents.iterdir())
    dom.destroy()


def test_a_metadata_change_keeps_heat_and_pins_unless_the_model_changes(env: LiveEnv) -> None:
    """Another program's metadata, then a smaller budget: the same engine goes on; a model change starts anew."""
    name = PREFIX + "meta"
    dom = env.domain(name, budget="16M")
    write_until_pinned(dom, 0, 8 * MiB, lambda: (s := env.status(name)) and s["disks"][0]["pinned_bytes"] or 0,
                       "the written region pinned")

    def cycles() -> int:
        return int(env.status(name)["disks"][0]["cycles"])

    before = cycles()
    dom.setMetadata(libvirt.VIR_DOMAIN_METADATA_ELEMENT, "<note>backup at 02:00</note>", "other",
                    "urn:x-another-program:1", libvirt.VIR_DOMAIN_AFFECT_LIVE)
    wait_for(lambda: "engines=kept" in env.agent_log(name), "the agent to see the other program's metadata")
    wait_for(lambda: cycles() >= before + 2, "two more cycles")
    assert env.status(name)["disks"][0]["pinned_bytes"] >= 8 * MiB  # nothing dropped: the pins held throughout
    assert cycles() >= before + 2  # the same engine: a new one counts from 0

    assert main(["enable", name, "--budget", "4M", "--live", "--host-config", str(env.config)]) == 0
    wait_for(lambda: 0 < env.status(name)["disks"][0]["pinned_bytes"] <= 4 * MiB, "the pins cut to the new budget")
    assert cycles() >= before + 2

    dom.setMetadata(libvirt.VIR_DOMAIN_METADATA_ELEMENT, "<cache budget='4M'><model decay='0.9'/></cache>",
                    "vmcache", "urn:x-vmcache:domain:1", libvirt.VIR_DOMAIN_AFFECT_LIVE)
    wait_for(lambda: "engines=rebuilt" in env.agent_log(name), "a model change to rebuild the engine")
    dom.destroy()
    wait_for(lambda: env.agent_pid(name) is None, "the agent to exit")


def test_two_domains_together_respect_the_host_wide_cap(env: LiveEnv) -> None:
    names = [PREFIX + "cap-a", PREFIX + "cap-b"]
    doms = [env.domain(n, budget="32M") for n in names]
    for n in names:
        wait_for(lambda n=n: (s := env.status(n)) and s["state"] in ("running", "backing-off"), f"agent of {n}")
    for dom in doms:
        guest_write(dom, 0, 16 * MiB)
    time.sleep(1)
    worst = 0
    for _ in range(8):
        pinned = [env.status(n)["disks"][0]["pinned_bytes"] for n in names]
        worst = max(worst, sum(pinned))
        time.sleep(0.5)
    assert 0 < worst <= CAP, pinned
    for dom in doms:
        dom.destroy()
    for n in names:
        wait_for(lambda n=n: env.agent_pid(n) is None, f"agent of {n} to exit")


def test_a_fast_restart_warms_from_the_set_the_last_agent_saved_as_it_stopped(env: LiveEnv) -> None:
    """destroy + start at once (or a snapshot revert, which restarts QEMU): libvirt copies the persistent
    definition into the new run before the old agent, stopping, saves its hot set there."""
    name = PREFIX + "fastwarm"
    dom = env.domain(name, persistent=True)
    try:
        old = wait_for(lambda: env.agent_pid(name), "the hook to start the agent")
        wait_for(lambda: (s := env.status(name)) and s["state"] == "running", "the agent's first cycle")
        write_until_pinned(dom, 8 * MiB, 4 * MiB, lambda: env.pinned(name), "the written region to be pinned")
        # the host config saves every 300 s: what the next run can warm from is saved at this stop only
        assert VirtDomain(env.conn, name).hotset(Affect.CONFIG) is None
        dom.destroy()
        dom.createWithFlags(libvirt.VIR_DOMAIN_START_PAUSED)   # at once, the old agent still stopping
        new = wait_for(lambda: (p := env.agent_pid(name)) and p != old and p, "the new run's agent")
        try:
            wait_for(lambda: (s := env.status(name)) and s["disks"] and s["disks"][0]["warm_total_bytes"] >= 4 * MiB,
                     "the new agent to warm from the set saved at the stop")
        except AssertionError as err:
            raise AssertionError(f"{err}\n{env.agent_log(name)[-2000:]}") from None
        # the guest is paused and reads nothing: what is locked came from the saved set
        wait_for(lambda: vmlck(new) >= 4 * MiB, "the saved region to be locked again")
    finally:
        if dom.isActive():
            dom.destroy()
        wait_for(lambda: env.agent_pid(name) is None, "the agent to exit")
        dom.undefine()


def _pages_read_apart(dom: object, first: int, blocks: int, part: int = 0, stride: int = 4) -> None:
    """The guest reads every ``stride``th 4 KiB page (every fourth by default) of ``blocks`` 1 MiB blocks from
    block ``first``, from page ``part``.

    The kernel's readahead reads exactly these (pages two apart, it takes for a sequential reader's; and a page
    right after cached ones starts its context readahead, so parts read later must not be next to earlier ones).
    """
    for page in range(first * 256 + part, (first + blocks) * 256, stride):
        guest_read(dom, page * 4096, 4096)


def _resident_beside(path: Path, offset: int, length: int, parts: tuple[int, ...] = (0,), stride: int = 4) -> int:
    """Pages of ``path`` cached in ``[offset, offset + length)`` other than the guest's: those ``parts`` of
    every ``stride``."""
    pages = scan_residency(path, 4096).blocks.index
    inside = pages[(pages >= offset // 4096) & (pages < (offset + length) // 4096)]
    return int((~np.isin((inside - offset // 4096) % stride, parts)).sum())


def _resident_pages(path: Path, offset: int, length: int) -> int:
    """Pages of ``path`` cached in ``[offset, offset + length)``, both whole MiB."""
    blocks = scan_residency(path, MiB).blocks
    inside = (blocks.index >= offset // MiB) & (blocks.index < (offset + length) // MiB)
    return round(float(blocks.value[inside].sum()) * (MiB // 4096))


def _locked_settled(pid: int) -> int:
    """``locked_pages(pid)``, the lesser of two looks apart: a reshaped pin is locked anew before its old mapping
    goes, and for that instant smaps counts its pages in both."""
    first = locked_pages(pid)
    time.sleep(0.2)
    return min(first, locked_pages(pid))


def test_with_fill_cached_the_agent_locks_what_the_guest_read_and_reads_nothing(env: LiveEnv) -> None:
    """``fill: cached``: the blocks the guest spreads through are pinned, but only the pages it read are locked."""
    name = PREFIX + "fillcached"
    image = env.disk(name, 64 * MiB)
    with open(image, "wb") as f:  # data, not holes: read from the file system
        f.write(b"\x5a" * (64 * MiB))
        os.fsync(f.fileno())
    drop(image)
    with env.config_override(fill="cached"):
        dom = env.domain(name, budget=None, image=image)
        try:
            assert main(["enable", name, "--budget", "16M", "--live", "--host-config", str(env.config)]) == 0
            pid = wait_for(lambda: env.agent_pid(name), "vmcache enable to start an agent")
            wait_for(lambda: (s := env.status(name)) and s["state"] == "running", "the agent's first cycle")
            locked = []
            for k in range(24):  # three eighths of 8 blocks, an eighth a few cycles at a time, then all three
                for part in (0, 2, 4)[:k // 3 + 1]:
                    _pages_read_apart(dom, 8, 8, part, stride=8)
                time.sleep(1.0)
                locked.append(_locked_settled(pid))
                if locked[-1] >= 2 * MiB:  # the three eighths pinned (the pins may not stay: not asked here)
                    break
            else:
                raise AssertionError(f"never pinned and locked: {locked}\n{env.agent_log(name)[-3000:]}")
            assert max(locked) <= 3 * MiB, locked  # what the guest read, at most (the host's reclaim may take some)
            beside = _resident_beside(image, 8 * MiB, 8 * MiB, parts=(0, 2, 4), stride=8)
            assert beside == 0, f"{beside} pages read beside the guest's\n{env.agent_log(name)[-3000:]}"
            # the status says what the pins hold beside what they count
            disk = wait_for(lambda: next((d for d in (env.status(name) or {}).get("disks", [])
                                          if isinstance(d.get("locked_bytes"), int) and d["locked_bytes"] > 0), None),
                            "a status with locked bytes")
            assert disk["locked_bytes"] <= 3 * MiB and disk["locked_bytes"] < disk["pinned_bytes"], disk
        finally:
            dom.destroy()
            wait_for(lambda: env.agent_pid(name) is None, "the agent to exit")


def test_the_agent_does_not_fill_blocks_the_guest_reads_the_same_quarter_of(env: LiveEnv) -> None:
    """A pin locks whole blocks: one the guest keeps reading a quarter of must not get the rest read for it."""
    name = PREFIX + "quarter"
    image = env.disk(name, 64 * MiB)
    with open(image, "wb") as f:  # data, not holes: read from the file system
        f.write(b"\x5a" * (64 * MiB))
        os.fsync(f.fileno())  # clean, so that it can be dropped
    drop(image)
    dom = env.domain(name, budget=None, image=image)
    try:
        _pages_read_apart(dom, 8, 16)  # before the agent: what it finds is one burst of the guest's
        assert _resident_beside(image, 8 * MiB, 16 * MiB) == 0 and _resident_pages(image, 8 * MiB, 16 * MiB) > 512
        assert main(["enable", name, "--budget", "16M", "--live", "--host-config", str(env.config)]) == 0
        wait_for(lambda: (s := env.status(name)) and s["state"] == "running", "vmcache enable to start an agent")
        for _ in range(8):  # the same quarter, again and again, over several cycles
            _pages_read_apart(dom, 8, 16)
            time.sleep(0.5)
        # only the pages beside the guest's: the host's reclaim may take some of the guest's own
        # (this machine's DAMON pages out page cache it saw read in at most 1 of 10 samples for a minute)
        beside = _resident_beside(image, 8 * MiB, 16 * MiB)
        assert beside == 0, f"{beside} pages read beside the guest's\n{env.agent_log(name)[-3000:]}"
    finally:
        dom.destroy()
        wait_for(lambda: env.agent_pid(name) is None, "the agent to exit")
