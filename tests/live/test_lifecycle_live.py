"""The agent follows each disk through what operators do (issue 12), with the real libvirtd, QEMU and agent.

Fast destroy/start, external snapshots and block jobs, backing chains,
block devices, two disks on one file, a deleted image, the HTTP server
under a burst. Domains start paused through the installed hook (the real
``vmcache agent``); "guest" writes are HMP ``qemu-io``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

libvirt = pytest.importorskip("libvirt")

from vmcache.host.files import file_stem  # noqa: E402

from tests.live.livelib import MiB, cache_metadata, domain_xml, loop_device, scrape, wait_for  # noqa: E402

from tests.live.guestlib import (guest_write, leftovers, pivot_when_ready, qmp, read_until_pinned,  # noqa: E402
                                 write_until_pinned)
from tests.live.livelib import LiveEnv  # noqa: E402
from tests.live.test_reliability_live import INTERVAL, cleanup, env, running  # noqa: E402,F401 - fixtures

pytestmark = pytest.mark.live

# `vmcache agent` with every QMP command it sends recorded with the domain run (libvirt's domain id)
# that received it, and the run that was current when the agent process started (the one the hook
# started it for). The run receiving a command is read from libvirt's status file of the domain, not
# asked of libvirtd: the command is sent under the run's gate, and libvirtd may be running the next
# start's hook, which waits for that gate (-1: no run has a QEMU).
_RECORDING = """
import json, os, re, sys
import libvirt, libvirt_qemu
record, name = {record!r}, sys.argv[sys.argv.index("--domain") + 1]
def live_id():
    try:
        text = open(f"/run/libvirt/qemu/{{name}}.xml").read()
    except OSError:
        return -1
    found = re.search(r"<domain type='[a-z]+' id='([0-9]+)'", text)
    return int(found.group(1)) if found else -1
def asked_id():
    conn = libvirt.open("qemu:///system")
    try:
        return conn.lookupByName(name).ID()
    except libvirt.libvirtError:
        return -1
    finally:
        conn.close()
started_for = asked_id()
_send = libvirt_qemu.qemuMonitorCommand
def send(dom, cmd, flags):
    line = json.dumps({{"agent": os.getpid(), "started_for": started_for, "received_by": live_id(),
                       "cmd": json.loads(cmd)["execute"]}})
    with open(record, "a") as f:
        f.write(line + "\\n")
    return _send(dom, cmd, flags)
libvirt_qemu.qemuMonitorCommand = send
# An agent descheduled between its run check and its command: while the file ``hold`` names this
# process, every check that passed waits there (``paused`` says so) until the file is gone.
import time
from vmcache.service.domainlink import DomainLink
hold, paused = record + ".hold", record + ".paused"
_check = DomainLink.check_run
def check_run(self):
    _check(self)
    try:
        held = open(hold).read().strip() == str(os.getpid())
    except OSError:
        held = False
    if held:
        open(paused, "w").write(str(os.getpid()))
        while os.path.exists(hold):
            time.sleep(0.02)
        open(paused, "a").write(" resumed")
DomainLink.check_run = check_run
from vmcache.cli import main
sys.exit(main(["agent", *sys.argv[1:]]))
"""


def agents_of(name: str) -> list[int]:
    """Pids of every process running as the agent of domain ``name``."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")[:-1]
        except OSError:
            continue
        if b"agent" in b" ".join(argv) and argv[-2:] == [b"--domain", name.encode()]:
            pids.append(int(entry))
    return pids


def _destroy_and_undefine(dom: Any, name: str) -> None:
    try:
        dom.destroy()
    except libvirt.libvirtError:
        pass
    wait_for(lambda: not agents_of(name), "the last agent to exit", timeout=30)
    dom.undefine()


def _assert_no_stray_command(record: Path) -> None:
    sent = [json.loads(line) for line in record.read_text().splitlines()]
    assert sent, "the recorder saw no QMP command"
    stray = [s for s in sent if s["received_by"] not in (s["started_for"], -1)]
    assert not stray, f"{len(stray)} commands reached another run's QEMU: {stray[:5]}"


def test_fast_destroy_start_twenty_rounds_end_with_one_agent_talking_only_to_its_own_qemu(env: LiveEnv, cleanup) -> None:
    name = "vmcache-test-life-race"
    record = env.tmp / "race-qmp.jsonl"
    command = [sys.executable, "-c", _RECORDING.format(record=str(record))]
    cleanup.append(name)
    xml = domain_xml(name, env.disk(name, 32 * MiB), metadata=cache_metadata("16M"))
    with env.config_override(agent_command=command):
        dom = env.live().defineXML(xml)
        try:
            dom.createWithFlags(libvirt.VIR_DOMAIN_START_PAUSED)
            running(env, name)
            for round_ in range(20):
                # Every fourth round the old agent is frozen across destroy/start: still holding its
                # lock mid-cycle when the new run starts, as a slow cleanup would be.
                frozen = agents_of(name) if round_ % 4 == 1 else []
                for pid in frozen:
                    os.kill(pid, signal.SIGSTOP)
                dom.destroy()
                dom.createWithFlags(libvirt.VIR_DOMAIN_START_PAUSED)
                for pid in frozen:
                    try:
                        os.kill(pid, signal.SIGCONT)
                    except ProcessLookupError:
                        pass  # frozen mid-command: the start's hook killed it after its wait
                run_id = dom.ID()

                def settled() -> bool:
                    status, pids = env.status(name), agents_of(name)
                    return (len(pids) == 1 and status is not None and status["pid"] == pids[0]
                            and status.get("domain_id") == run_id and status["state"] == "running")

                try:
                    wait_for(settled, f"round {round_}: one agent, running for domain run {run_id}", timeout=30)
                except AssertionError as err:
                    raise AssertionError(f"{err}: agents {agents_of(name)}, status {env.status(name)}\n"
                                         f"hook log:\n{env.hook_log()[-2000:]}\n"
                                         f"agent log:\n{env.agent_log(name)[-3000:]}") from None
        finally:
            _destroy_and_undefine(dom, name)
    _assert_no_stray_command(record)
    assert not list(env.agents.glob(f"{file_stem(name)}*.pid")), "a pidfile was left behind"
    assert "agent.started-after" in env.hook_log()  # the frozen rounds took the successor path
    assert "hook.fence" in env.hook_log()  # and their gates were fenced before the new QEMU started


def test_an_agent_held_between_its_run_check_and_its_command_sends_nothing_to_the_next_run(env: LiveEnv, cleanup) -> None:
    """The window a run check alone leaves open: checked against run N, sent after run N+1 started."""
    name = "vmcache-test-life-gate"
    record = env.tmp / "gate-qmp.jsonl"
    hold, paused = Path(f"{record}.hold"), Path(f"{record}.paused")
    cleanup.append(name)
    xml = domain_xml(name, env.disk(name, 32 * MiB), metadata=cache_metadata("16M"))
    with env.config_override(agent_command=[sys.executable, "-c", _RECORDING.format(record=str(record))]):
        dom = env.live().defineXML(xml)
        try:
            dom.createWithFlags(libvirt.VIR_DOMAIN_START_PAUSED)
            old = running(env, name)["pid"]
            hold.write_text(str(old))
            wait_for(paused.exists, "the old agent held after a run check that passed", timeout=30)
            dom.destroy()
            dom.createWithFlags(libvirt.VIR_DOMAIN_START_PAUSED)
            new_run, uuid = dom.ID(), dom.UUIDString()
            hold.unlink()
            wait_for(lambda: "resumed" in paused.read_text(), "the old agent to go on", timeout=30)
            wait_for(lambda: (s := env.status(name)) is not None and s.get("domain_id") == new_run
                     and s["state"] == "running" and agents_of(name) == [s["pid"]],
                     f"one agent, running for run {new_run}", timeout=30)
        finally:
            _destroy_and_undefine(dom, name)
    _assert_no_stray_command(record)
    assert "hook.fence" in env.hook_log()
    assert not list(Path("/run/lock/vmcache").glob(f"{uuid}.*")), "a gate or run lock was left behind"


# -- external snapshots and block jobs --------------------------------------------------------------


def _disk(env: LiveEnv, name: str, target: str = "vda") -> Any:
    status = env.status(name)
    return next((d for d in status["disks"] if d["target"] == target), None) if status else None


def _written(env: LiveEnv, name: str) -> float:
    return scrape(env.status(name)["metrics_url"], "vmcache_guest_dirtied_bytes_total")


def _follows(env: LiveEnv, name: str, image: Path, dom, offset: int, what: str) -> None:
    """The agent manages ``image`` as vda, counts a 4 MiB write at ``offset`` on it and pins it once read back
    (3 MiB of it at least: a block the data shares with qcow2's metadata is read in part)."""
    try:
        wait_for(lambda: (d := _disk(env, name)) and d["source"] == str(image) and not d["error"],
                 f"the agent to follow {what}", timeout=15)
        before = _written(env, name)
        guest_write(dom, offset, 4 * MiB)
        wait_for(lambda: _written(env, name) - before >= 4 * MiB, f"writes on {what} to be counted", timeout=15)
        read_until_pinned(dom, offset, 4 * MiB, lambda: (d := _disk(env, name)) and d["pinned_bytes"] or 0,
                          f"pins on {what}", timeout=15, at_least=3 * MiB)
    except AssertionError as err:
        from urllib.request import urlopen
        text = [line for line in urlopen(env.status(name)["metrics_url"]).read().decode().splitlines()
                if "dirtied" in line]
        raise AssertionError(f"{err}: {text}\n{env.status(name)}\n{env.agent_log(name)[-4000:]}") from None
    maps = Path(f"/proc/{env.agent_pid(name)}/maps").read_text()
    assert str(image) in maps, f"{what} is not pinned"


@pytest.mark.parametrize("fill", ["whole", "cached"])
def test_external_snapshot_and_blockcommit_pivot_are_followed_and_never_fail(env: LiveEnv, cleanup, fill: str) -> None:
    """Each image the disk moves to is pinned where the guest writes, with either ``fill``.

    With ``fill: cached`` the second overlay's first block (qcow2 metadata, a few pages of it never
    written, and the guest's data) was left out: a block not cached whole that the guest never read.
    """
    name = "vmcache-test-life-snap" + ("" if fill == "whole" else "-cached")
    with env.config_override(fill=fill):
        _snapshots_commit_and_pull(env, name)


def _snapshots_commit_and_pull(env: LiveEnv, name: str) -> None:
    dom = env.domain(name, budget="16M", size=32 * MiB)
    base = env.tmp / f"{file_stem(name)}.raw"
    running(env, name)
    pid = env.agent_pid(name)
    write_until_pinned(dom, 0, 4 * MiB, lambda: env.pinned(name), "a pin on the base image")

    overlay = env.tmp / f"{file_stem(name)}-s1.qcow2"
    dom.snapshotCreateXML(
        f"<domainsnapshot><name>s1</name><disks><disk name='vda' snapshot='external'>"
        f"<driver type='qcow2'/><source file='{overlay}'/></disk></disks></domainsnapshot>",
        libvirt.VIR_DOMAIN_SNAPSHOT_CREATE_DISK_ONLY | libvirt.VIR_DOMAIN_SNAPSHOT_CREATE_NO_METADATA)
    _follows(env, name, overlay, dom, 8 * MiB, "the snapshot's overlay")
    assert "disk.image_changed" in env.agent_log(name)

    # Active blockcommit of the overlay into the base, then pivot: the base is the top again.
    dom.blockCommit("vda", None, None, 0, libvirt.VIR_DOMAIN_BLOCK_COMMIT_ACTIVE)
    pivot_when_ready(dom, "vda")
    _follows(env, name, base, dom, 16 * MiB, "the base after the commit")
    assert env.agent_pid(name) == pid  # followed, not restarted
    maps = Path(f"/proc/{pid}/maps").read_text()
    assert str(overlay) not in maps  # the committed overlay's pins went with it
    left = leftovers(dom)
    assert len(left["bitmaps"]) == 1 and left["exports"] == [], left

    # A second snapshot, then blockpull: the base's data pulled into the overlay, which stays the top.
    overlay2 = env.tmp / f"{file_stem(name)}-s2.qcow2"
    dom.snapshotCreateXML(
        f"<domainsnapshot><name>s2</name><disks><disk name='vda' snapshot='external'>"
        f"<driver type='qcow2'/><source file='{overlay2}'/></disk></disks></domainsnapshot>",
        libvirt.VIR_DOMAIN_SNAPSHOT_CREATE_DISK_ONLY | libvirt.VIR_DOMAIN_SNAPSHOT_CREATE_NO_METADATA)
    _follows(env, name, overlay2, dom, 20 * MiB, "the second snapshot's overlay")
    dom.blockPull("vda", 0, 0)
    wait_for(lambda: not dom.blockJobInfo("vda", 0), "the pull to finish", timeout=60)
    _follows(env, name, overlay2, dom, 24 * MiB, "the overlay after the pull")
    assert env.agent_pid(name) == pid


def test_an_active_commit_waiting_for_its_pivot_leaves_the_agent_cycling(env: LiveEnv, cleanup) -> None:
    """While an active commit waits for the operator's pivot, QEMU shows the job's bitmap without a name."""
    name = "vmcache-test-life-ready"
    dom = env.domain(name, budget="16M", size=32 * MiB)
    running(env, name)
    pid = env.agent_pid(name)
    overlay = env.tmp / "ready-s1.qcow2"
    dom.snapshotCreateXML(
        f"<domainsnapshot><disks><disk name='vda' snapshot='external'><driver type='qcow2'/>"
        f"<source file='{overlay}'/></disk></disks></domainsnapshot>",
        libvirt.VIR_DOMAIN_SNAPSHOT_CREATE_DISK_ONLY | libvirt.VIR_DOMAIN_SNAPSHOT_CREATE_NO_METADATA)
    _follows(env, name, overlay, dom, 0, "the snapshot's overlay")
    dom.blockCommit("vda", None, None, 0, libvirt.VIR_DOMAIN_BLOCK_COMMIT_ACTIVE)
    wait_for(lambda: (i := dom.blockJobInfo("vda", 0)) and i["end"] > 0 and i["cur"] == i["end"], "the commit ready")
    nodes = qmp(dom, "query-named-block-nodes", {"flat": True})
    assert any("name" not in b for n in nodes for b in n.get("dirty-bitmaps", [])), "no anonymous job bitmap"
    cycles = env.status(name)["disks"][0]["cycles"]
    guest_write(dom, 4 * MiB, 2 * MiB)
    wait_for(lambda: env.status(name)["disks"][0]["cycles"] >= cycles + 3, "three cycles during the job")
    status = env.status(name)
    assert env.agent_pid(name) == pid and status["state"] == "running", status
    assert status["disks"][0]["error"] is None and status["last_error"] is None, status
    pivot_when_ready(dom, "vda")
    _follows(env, name, env.tmp / f"{file_stem(name)}.raw", dom, 8 * MiB, "the base after the commit")
    assert "Traceback" not in env.agent_log(name)


# -- block devices ----------------------------------------------------------------------------------


def test_block_device_disk_is_scanned_tracked_and_pinned(env: LiveEnv, cleanup) -> None:
    name = "vmcache-test-life-block"
    with loop_device(env.tmp / "vmcache-life-loop.img", 32 * MiB) as dev:
        disk = (f"<disk type='block' device='disk'><driver name='qemu' type='raw' cache='writethrough'/>"
                f"<source dev='{dev}'/><target dev='vdb' bus='virtio'/><alias name='ua-vdb'/></disk>")
        dom = env.domain(name, budget="32M", size=32 * MiB, devices=disk)
        running(env, name)
        before = _written(env, name)
        guest_write(dom, 4 * MiB, 4 * MiB, dev="ua-vdb")
        try:
            wait_for(lambda: _written(env, name) - before >= 4 * MiB, "writes on the device to be counted")
            write_until_pinned(dom, 4 * MiB, 4 * MiB, lambda: (d := _disk(env, name, "vdb")) and d["pinned_bytes"] or 0,
                               "the device to be pinned", dev="ua-vdb")
        except AssertionError as err:
            raise AssertionError(f"{err}: {_disk(env, name, 'vdb')}\n{env.agent_log(name)[-3000:]}") from None
        assert dev in Path(f"/proc/{env.agent_pid(name)}/maps").read_text()
        scan = subprocess.run([sys.executable, "-m", "vmcache", "scan", "--json", dev], capture_output=True,
                              text=True, check=True)
        report = json.loads(scan.stdout)
        assert report["size_bytes"] == 32 * MiB and report["resident_pages"] * 4096 >= 4 * MiB, report
        env.lookup(name).destroy()
        wait_for(lambda: env.agent_pid(name) is None, "the agent to exit")


# -- two disks on one file --------------------------------------------------------------------------


def test_two_disks_on_one_file_are_matched_by_device_and_the_file_managed_once(env: LiveEnv, cleanup) -> None:
    name = "vmcache-test-life-shared"
    shared = env.tmp / "vmcache-life-shared.raw"
    with open(shared, "wb") as f:
        f.truncate(32 * MiB)
    disks = "".join(
        f"<disk type='file' device='disk'><driver name='qemu' type='raw' cache='writethrough'/>"
        f"<source file='{shared}'/><target dev='{dev}' bus='virtio'/><shareable/><alias name='ua-{dev}'/></disk>"
        for dev in ("vdb", "vdc"))
    dom = env.domain(name, budget="32M", size=32 * MiB, devices=disks)
    running(env, name)
    wait_for(lambda: _disk(env, name, "vdc") is not None, "vdc in the status")
    managed = [d for d in env.status(name)["disks"] if d["source"] == str(shared) and d["eligible"]]
    skipped = [d for d in env.status(name)["disks"] if d["source"] == str(shared) and not d["eligible"]]
    assert [d["target"] for d in managed] == ["vdb"] and [d["target"] for d in skipped] == ["vdc"], env.status(name)
    assert "vdb" in skipped[0]["reason"]
    before = _written(env, name)
    guest_write(dom, 0, 4 * MiB, dev="ua-vdb")
    wait_for(lambda: _written(env, name) - before >= 4 * MiB, "vdb's writes to be counted")
    write_until_pinned(dom, 0, 4 * MiB, lambda: _disk(env, name, "vdb")["pinned_bytes"], "the shared file to be pinned",
                       dev="ua-vdb")
    time.sleep(3 * INTERVAL)  # cycles go by: no disk's bitmap is removed as another's stale one
    log = env.agent_log(name)
    assert "tracker.read_failed" not in log and "stale" not in log, log[-3000:]
    assert all(not d["error"] for d in env.status(name)["disks"]), env.status(name)
    bitmaps = leftovers(dom)["bitmaps"]
    assert len(bitmaps) == 2, bitmaps  # vda's and vdb's, each on its own node
    maps = Path(f"/proc/{env.agent_pid(name)}/maps").read_text()
    assert maps.count(str(shared)) >= 1


# -- the agent's HTTP server under a burst ----------------------------------------------------------


def _get(url: str, method: str = "GET") -> int | str:
    """The HTTP status of one request, or the name of the error that ended it (a reset connection)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method, data=b"x" if method == "POST" else None),
                                    timeout=120) as reply:
            reply.read()
            return int(reply.status)
    except urllib.error.HTTPError as err:
        return int(err.code)
    except OSError as err:
        return type(err.reason if isinstance(err, urllib.error.URLError) else err).__name__


def test_a_burst_of_heatmap_requests_resets_none_and_metrics_keep_answering(env: LiveEnv, cleanup) -> None:
    from concurrent.futures import ThreadPoolExecutor

    name = "vmcache-test-life-http"
    dom = env.domain(name, budget="16M", size=32 * MiB)
    running(env, name)
    guest_write(dom, 0, 4 * MiB)
    url = env.status(name)["metrics_url"]
    page = url.replace("/metrics", "/heatmap/vda.png")
    assert _get(page) == 200
    assert _get(page, "POST") == 405
    with ThreadPoolExecutor(max_workers=1000) as pool:
        burst = [pool.submit(_get, page) for _ in range(1000)]
        during = _get(url)  # a scrape in the middle of the burst
        answers = [f.result() for f in burst]
    assert during == 200
    failed = [a for a in answers if a not in (200, 503)]
    assert not failed, f"{len(failed)} of 1000 heat-map requests failed: {sorted(set(map(str, failed)))}"


# -- a deleted image --------------------------------------------------------------------------------


def _pinned_image(env: LiveEnv, cleanup: list[str], name: str) -> tuple[Any, Path]:
    """A running domain ``name`` whose agent pins 4 MiB its guest wrote, and the image's path."""
    dom = env.domain(name, budget="16M", size=32 * MiB)
    running(env, name)
    write_until_pinned(dom, 0, 4 * MiB, lambda: env.pinned(name))
    return dom, env.tmp / f"{file_stem(name)}.raw"


def test_a_deleted_image_is_reported_and_its_pins_released_once_qemu_no_longer_writes_it(env: LiveEnv, cleanup) -> None:
    name = "vmcache-test-life-deleted"
    _, image = _pinned_image(env, cleanup, name)
    image.unlink()
    try:
        wait_for(lambda: (d := _disk(env, name)) and d.get("image_deleted") and d["pinned_bytes"] == 0,
                 "the deletion to be reported and the pins released")
    except AssertionError as err:
        raise AssertionError(f"{err}: {_disk(env, name)}\n{env.agent_log(name)[-3000:]}") from None
    assert scrape(env.status(name)["metrics_url"], "vmcache_image_deleted", {"target_device": "vda"}) == 1
    assert "disk.image_deleted" in env.agent_log(name)
    maps = Path(f"/proc/{env.agent_pid(name)}/maps").read_text()
    assert str(image) not in maps  # nothing of the deleted file stays locked


def test_a_deleted_image_stays_pinned_while_qemu_still_writes_it(env: LiveEnv, cleanup) -> None:
    """An image unlinked under a running guest is QEMU's only copy while it writes: its pins stay, reported."""
    name = "vmcache-test-life-deleted-writing"
    dom, image = _pinned_image(env, cleanup, name)
    stop = threading.Event()

    def keep_writing() -> None:  # several writes in every 1 s cycle
        while not stop.wait(0.2):
            guest_write(dom, 0, 64 * 1024, pattern=0xCD)

    writer = threading.Thread(target=keep_writing, daemon=True)
    writer.start()
    try:
        image.unlink()
        wait_for(lambda: (d := _disk(env, name)) and d.get("image_deleted"), "the deletion to be reported")
        seen = _disk(env, name)["cycles"]
        while (d := _disk(env, name))["cycles"] < seen + 4:
            assert d["image_deleted"] and d["pinned_bytes"] >= 4 * MiB, (d, env.agent_log(name)[-2000:])
            time.sleep(0.1)
    finally:
        stop.set()
        writer.join(timeout=10)
    wait_for(lambda: (d := _disk(env, name)) and d["pinned_bytes"] == 0,
             "the pins to go once QEMU stopped writing the deleted image")
    assert _disk(env, name)["image_deleted"]


# -- a second agent for the same run --------------------------------------------------------------


def test_a_second_agent_with_another_host_config_is_refused_and_removes_nothing(env: LiveEnv, cleanup) -> None:
    """An agent started by hand (or by another hook) with another runtime dir: before the run lock it ran
    beside the hook's agent and removed that agent's recording bitmap as stale."""
    name = "vmcache-test-life-second"
    dom, _ = _pinned_image(env, cleanup, name)
    other = env.tmp / "second-config"
    other.mkdir(exist_ok=True)
    config = other / "vmcache.yaml"
    config.write_text(yaml.safe_dump({**env.base, "runtime_dir": f"{other}/run", "log_dir": f"{other}/log"}))
    second = subprocess.Popen([sys.executable, "-m", "vmcache", "agent", "--domain", name, "--host-config",
                               str(config)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = second.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        second.kill()
        out, _ = second.communicate()
        raise AssertionError(f"the second agent kept running:\n{out[-3000:]}") from None
    logs = out + "".join(p.read_text(errors="replace") for p in (other / "log").glob("*.log"))
    assert second.returncode == 0, logs[-3000:]
    assert "agent.refused" in logs and "tracker.stale_bitmaps" not in logs, logs[-3000:]
    # The first agent still counts the guest's writes: its bitmap is where it was.
    written = _written(env, name)
    guest_write(dom, 8 * MiB, MiB)
    wait_for(lambda: _written(env, name) >= written + MiB, "the write to be counted by the first agent")
    assert "tracker.read_failed" not in env.agent_log(name)
