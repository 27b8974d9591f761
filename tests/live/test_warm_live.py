"""Warm start on real libvirt domains: the hot set saved in the domain XML survives stop/start,
save/restore, managedsave and a dumpxml -> define copy, and the next agent pins it again before the
guest has read it; a changed image or a hostile saved set means a cold start, never a failed one.

Domains are persistent (stop/start and managedsave need a definition), TCG, started paused: the
guest never reads, so whatever the new agent pins comes from the saved set. "Guest" writes are HMP
``qemu-io`` through the virtio device. Everything is removed at the end, even on failure.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import replace
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

libvirt = pytest.importorskip("libvirt")

from vmcache.host.pagecache import scan_residency  # noqa: E402
from vmcache.host.virtdomain import Affect, VirtDomain  # noqa: E402
from vmcache.model.region import Region  # noqa: E402
from vmcache.settings.hotset import HOTSET_NAMESPACE, MAX_TEXT, DiskHotSet, HotSet  # noqa: E402

from tests.live.livelib import MiB, LiveEnv, agents_env, cache_metadata, wait_for  # noqa: E402

from tests.live.guestlib import covered, guest_read, guest_write, mapped, write_until_pinned  # noqa: E402
from tests.pagecache_util import drop, vmlck  # noqa: E402

pytestmark = pytest.mark.live

PREFIX = f"vmcache-test-warm-{os.getpid()}-"
BUDGET = 16 * MiB


@pytest.fixture(scope="module")
def env(live_tmp: Path, hooked) -> Iterator[LiveEnv]:
    # 2 MiB a cycle of each disk's prefetch and 2 MiB of the host's warm-up budget: a set > 4 MiB takes steps
    yield from agents_env(live_tmp, hooked, PREFIX, hotset_interval="2s", prefetch_rate="2M", warm_rate="2M",
                          model={"block_size": "1M"})


def agent_gone(env: LiveEnv, name: str) -> None:
    wait_for(lambda: env.agent_pid(name) is None, f"{name}'s agent to exit")


def first_run(env: LiveEnv, name: str) -> tuple[Any, Path, DiskHotSet]:
    """An opted-in domain whose guest wrote two regions and reads them back, pinned and saved in its XML;
    (dom, image, record)."""
    image = env.disk(name, 64 * MiB)
    dom = env.domain(name, image=image, persistent=True)
    wait_for(lambda: (s := env.status(name)) and s["state"] == "running", "the agent's first cycle")
    # 4 MiB each: at the default decay a region written once settles at a heat of 0.25-0.33 if 4 MiB
    # long, 0.17-0.20 if 2 MiB, around the threshold (0.2): such a one may never be pinned
    write_until_pinned(dom, 8 * MiB, 4 * MiB, lambda: env.pinned(name), "the written regions to be pinned",
                       more=[(40 * MiB, 4 * MiB)])

    def read_back() -> None:
        guest_read(dom, 8 * MiB, 4 * MiB)
        guest_read(dom, 40 * MiB, 4 * MiB)

    record = wait_saved(env, name, 8 * MiB, read_back)
    assert record.image == str(image) and record.size == 64 * MiB and record.image_id
    assert record.bytes <= BUDGET
    return dom, image, record


def wait_saved(env: LiveEnv, name: str, at_least: int, read_back: Callable[[], object] | None = None) -> DiskHotSet:
    """Wait for the agent to save a hot set of ``at_least`` bytes for vda in the live XML; that record.

    ``read_back``: the guest's reads, once a poll. Where reads are counted the live set (what a migration, a
    save or a managed save carries, the guest's memory with it) holds only blocks the guest reads again.
    """
    def saved() -> DiskHotSet | None:
        if read_back is not None:
            read_back()
        hotset = VirtDomain(env.conn, name).hotset(Affect.LIVE)
        record = hotset.disk("vda") if hotset else None
        return record if record is not None and record.bytes >= at_least else None

    return wait_for(saved, "the agent to save the hot set in the live XML")


def stop_start(env: LiveEnv, name: str, dom: Any, image: Path) -> Any:
    dom.destroy()
    agent_gone(env, name)
    drop(image)
    dom.createWithFlags(libvirt.VIR_DOMAIN_START_PAUSED)
    return dom


def save_restore(env: LiveEnv, name: str, dom: Any, image: Path) -> Any:
    state = env.tmp / f"{name}.save"
    dom.save(str(state))
    agent_gone(env, name)
    drop(image)
    env.conn.restore(str(state))
    state.unlink()
    return env.conn.lookupByName(name)


def managed_save(env: LiveEnv, name: str, dom: Any, image: Path) -> Any:
    dom.managedSave()
    agent_gone(env, name)
    drop(image)
    assert dom.hasManagedSaveImage()
    dom.createWithFlags(libvirt.VIR_DOMAIN_START_PAUSED)
    return dom


def define_copy(env: LiveEnv, name: str, dom: Any, image: Path) -> Any:
    """``virsh dumpxml`` -> ``virsh define`` under a fresh name (what reaches a migration's destination)."""
    # the persistent definition gets the set at a periodic save (a stopping agent saves to the host's copy
    # alone, keyed by the uuid the copy will not have): wait for one, or the copy starts cold
    wait_for(lambda: VirtDomain(env.conn, name).hotset(Affect.CONFIG), "a periodic save into the persistent XML")
    dom.destroy()
    agent_gone(env, name)
    xml = dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)
    dom.undefine()
    drop(image)
    xml = re.sub(r"<uuid>[^<]*</uuid>", "", xml).replace(f"<name>{name}</name>", f"<name>{name}-copy</name>")
    copy = env.conn.defineXML(xml)
    copy.createWithFlags(libvirt.VIR_DOMAIN_START_PAUSED)
    return copy


@pytest.mark.parametrize("restart", [stop_start, save_restore, managed_save, define_copy],
                         ids=["stop-start", "save-restore", "managedsave", "dumpxml-define"])
def test_the_next_agent_pins_the_saved_regions_before_the_guest_reads_them(
        env: LiveEnv, restart: Callable[[LiveEnv, str, Any, Path], Any]) -> None:
    name = PREFIX + restart.__name__.replace("_", "-")
    dom, image, record = first_run(env, name)
    dom = restart(env, name, dom, image)
    name = dom.name()
    pid = wait_for(lambda: env.agent_pid(name), "the hook to start the new agent")
    status = wait_for(lambda: (s := env.status(name)) and s["disks"] and s["disks"][0]["warm_total_bytes"] and s,
                      "the new agent to warm from the saved set")
    assert status["disks"][0]["warm_total_bytes"] == record.bytes
    assert "hotset.warming disk=vda" in env.agent_log(name)
    # The guest is paused: it reads nothing. What is locked now came from the saved set.
    seen = wait_mapped(pid, image, record.regions, "the saved regions to be locked again")
    assert union_bytes(seen[-1]) <= BUDGET, seen[-1]
    status = wait_for(lambda: (s := env.status(name)) and s["disks"][0]["warm_restored_bytes"] == record.bytes and s,
                      "the status to show the set restored")
    assert status["disks"][0]["pinned_bytes"] <= BUDGET
    dom.destroy()
    agent_gone(env, name)
    dom.undefineFlags(libvirt.VIR_DOMAIN_UNDEFINE_MANAGED_SAVE)


def wait_mapped(pid: int, image: Path, regions: Sequence[Region], what: str, **wait: float
                ) -> list[list[tuple[int, int]]]:
    """Poll agent ``pid``'s mappings of ``image`` until they cover every region; the mappings of each poll.

    Not VmLck: while a pin grows, its old and its new mapping are both counted for a moment.
    """
    seen: list[list[tuple[int, int]]] = []

    def covering() -> bool:
        seen.append(ranges := mapped(pid, image))
        return all(covered(ranges, region.start, region.length) for region in regions)

    wait_for(covering, what, **wait)
    return seen


def union_bytes(ranges: list[tuple[int, int]]) -> int:
    """Bytes of the image the ``ranges`` map, each counted once (a reshape maps the old and the new pin)."""
    total, end = 0, 0
    for start, length in sorted(ranges):
        total += max(0, start + length - max(start, end))
        end = max(end, start + length)
    return total


START = 48 * MiB


def test_a_large_saved_region_is_restored_in_steps_never_over_budget(env: LiveEnv) -> None:
    """14 MiB saved, 4 MiB a cycle (prefetch_rate 2M and the host's warm_rate 2M, 1 s cycles): the new agent locks it
    in steps from its first cycle, one pin grown from the start, the status shows it partly restored."""
    name = PREFIX + "chunked"
    dom, image, record = first_run(env, name)
    dom.destroy()
    agent_gone(env, name)
    # away from what the first run pinned (8-12 and 40-44 MiB and their margins), so none of it is cached
    # (a chunk pays for uncached bytes only); mean heat 1.0 a block: well above the threshold
    big = replace(record, regions=(Region(START, 14 * MiB, 14.0),))
    VirtDomain(env.conn, name).set_hotset(HotSet(int(time.time()), (big,)), Affect.CONFIG)
    drop(image)
    cached = scan_residency(image, MiB).blocks.index
    assert not ((cached >= START // MiB) & (cached < START // MiB + 14)).any(), "the region should not be cached"
    before = len(env.agent_log(name))  # the first agent's lines
    dom.createWithFlags(libvirt.VIR_DOMAIN_START_PAUSED)
    pid = wait_for(lambda: env.agent_pid(name), "the hook to start the new agent")
    seen = wait_mapped(pid, image, big.regions, "the saved region to be locked whole", timeout=60, step=0.05)
    held = [union_bytes(ranges) for ranges in seen]
    assert max(held) <= BUDGET, held  # pages locked at any moment, each counted once
    # the last step is logged just after it is locked: read the log once the restore says it is done
    log = wait_for(lambda: "warm.done" in (text := env.agent_log(name)[before:]) and text, "warm.done in the log")
    grown = [int(m) for m in re.findall(rf"pin\.add start={START} length=(\d+)", log)]
    assert len(grown) >= 4 and grown == sorted(grown) and grown[-1] == 14 * MiB, grown
    steps = [b - a for a, b in zip([0, *grown], grown)]
    # never more than one cycle's tokens at once: its own prefetch_rate's and the host's warm-up budget's
    assert max(steps) <= 4 * MiB, steps
    partial = [int(m) for m in re.findall(r"warm\.progress image=\S+ restored=(\d+) total=14680064", log)]
    assert partial and 0 < partial[0] <= 4 * MiB and partial == sorted(partial), partial
    assert re.search(r"warm\.done image=\S+ restored=14680064 ", log), log[-2000:]
    status = wait_for(lambda: (s := env.status(name)) and s["disks"][0]["warm_restored_bytes"] == 14 * MiB and s,
                      "the status to show the set restored")
    assert status["disks"][0]["pinned_bytes"] <= BUDGET and vmlck(pid) <= BUDGET
    dom.destroy()
    agent_gone(env, name)
    dom.undefine()


def test_a_smaller_budget_restores_the_highest_priority_regions_only(env: LiveEnv) -> None:
    name = PREFIX + "smaller-budget"
    dom, image, record = first_run(env, name)
    dom.destroy()
    agent_gone(env, name)
    top = record.regions[0]  # highest priority first
    budget = top.length + MiB  # room for the top region, not for the whole set
    assert record.bytes > budget
    dom.setMetadata(libvirt.VIR_DOMAIN_METADATA_ELEMENT, f"<cache budget='{budget}'/>", "vmcache",
                    "urn:x-vmcache:domain:1", libvirt.VIR_DOMAIN_AFFECT_CONFIG)
    drop(image)
    dom.createWithFlags(libvirt.VIR_DOMAIN_START_PAUSED)
    pid = wait_for(lambda: env.agent_pid(name), "the hook to start the new agent")
    wait_for(lambda: vmlck(pid) >= top.length, "the top saved region to be locked")
    assert covered(mapped(pid, image), top.start, top.length)
    status = wait_for(lambda: (s := env.status(name)) and s["disks"] and s["disks"][0]["warm_total_bytes"] and s,
                      "the status")
    assert status["disks"][0]["pinned_bytes"] <= budget and vmlck(pid) <= budget
    dom.destroy()
    agent_gone(env, name)
    dom.undefine()


@pytest.mark.parametrize("change", ["resize", "replace"])
def test_a_changed_image_ignores_the_saved_set(env: LiveEnv, change: str) -> None:
    name = PREFIX + "changed-" + change
    dom, image, _record = first_run(env, name)
    dom.destroy()
    agent_gone(env, name)
    if change == "resize":
        os.truncate(image, 80 * MiB)  # qemu-img resize / virsh blockresize on a stopped domain
    else:
        fresh = image.with_suffix(".new")
        shutil.copyfile(image, fresh)  # another image (a reinstall, a restored backup) put in its place
        os.replace(fresh, image)
    drop(image)
    dom.createWithFlags(libvirt.VIR_DOMAIN_START_PAUSED)
    wait_for(lambda: (s := env.status(name)) and s["state"] == "running", "the new agent's first cycle")
    log = wait_for(lambda: "hotset.ignored disk=vda" in (text := env.agent_log(name)) and text,
                   "the agent to say why it ignores the saved set")
    reason = "bytes" if change == "resize" else "replaced"
    assert reason in log.split("hotset.ignored disk=vda", 1)[1].splitlines()[0]
    status = env.status(name)
    assert status["disks"][0]["warm_total_bytes"] == 0 and status["disks"][0]["pinned_bytes"] == 0
    dom.destroy()
    agent_gone(env, name)
    dom.undefine()


def _hostile(kind: str) -> str:
    ns = f"xmlns:h='{HOTSET_NAMESPACE}'"
    if kind == "version":
        return f"<h:hotset {ns} version='9' saved='1'/>"
    if kind == "regions":
        return (f"<h:hotset {ns} version='1' saved='1'><h:disk dev='vda' image='/x' size='1' block='4096'>"
                "!!!</h:disk></h:hotset>")
    return (f"<h:hotset {ns} version='1' saved='1'><h:disk dev='vda' image='/x' size='1' block='4096'>"
            + "A" * (MAX_TEXT + 16) + "</h:disk></h:hotset>")


@pytest.mark.parametrize("kind", ["version", "regions", "oversized"])
def test_hostile_saved_set_is_one_line_and_a_cold_start(env: LiveEnv, kind: str) -> None:
    name = PREFIX + "hostile-" + kind
    image = env.disk(name, 64 * MiB)
    metadata = cache_metadata("16M").replace("</metadata>", _hostile(kind) + "</metadata>")
    dom = env.domain(name, image=image, metadata=metadata, persistent=True)
    assert dom.isActive()  # the hook never reads the hot set: the start cannot fail on it
    wait_for(lambda: (s := env.status(name)) and s["state"] == "running", "the agent to run (cold)")
    lines = [line for line in env.agent_log(name).splitlines() if "hotset.unusable" in line]
    assert len(lines) == 1 and "cold start" in lines[0] and len(lines[0]) < 400, lines
    guest_write(dom, 0, 4 * MiB)  # and it works as usual (4 MiB: first_run says why)
    wait_for(lambda: env.pinned(name) >= 2 * MiB, "a pin after the cold start")
    dom.destroy()
    agent_gone(env, name)
    dom.undefine()


def test_disable_remove_and_undefine_leave_no_saved_set(env: LiveEnv) -> None:
    from vmcache.cli import main

    name = PREFIX + "remove"
    dom, _image, _record = first_run(env, name)
    assert main(["disable", name, "--remove", "--live", "--config", "--host-config", str(env.config)]) == 0
    agent_gone(env, name)  # it saved nothing on its way out: the element it would save for is gone
    virt = VirtDomain(env.conn, name)
    assert virt.hotset(Affect.LIVE) is None and virt.hotset(Affect.CONFIG) is None
    assert HOTSET_NAMESPACE not in dom.XMLDesc(0)
    dom.destroy()
    dom.undefine()
    assert name not in [d.name() for d in env.conn.listAllDomains()]
