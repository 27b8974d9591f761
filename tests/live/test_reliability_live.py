"""Reliability and security of the real agent, with libvirtd, QEMU and real memory (issue 7).

Every test starts transient TCG domains (paused: "guest" writes are HMP
``qemu-io`` on the virtio disk) through the installed libvirt hook, which
starts the real ``vmcache agent``. Situations are reproduced with the real
components: a memory eater in a bounded memory cgroup, ``kill -9`` of the
agent, a libvirtd restart, a libvirt pull-mode backup, ``blockresize``, a
SCSI disk hot-unplug, hostile metadata. Each test checks that nothing is
lost and nothing is left behind (bitmaps, nodes, exports, sockets, files).

Where the real source cannot be driven safely (memory PSI), the agent runs
through an *instrumented* agent command: the same ``vmcache agent``, with
its PSI file pointed at a file the test writes, and every QMP command it
sends recorded below vmcache's own allow-list.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
import uuid as uuidlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

libvirt = pytest.importorskip("libvirt")

from vmcache.host.configfile import CACHE_DIR  # noqa: E402
from vmcache.host.qmp import ALLOWED_COMMANDS, TRANSACTION_ACTIONS  # noqa: E402
from vmcache.settings.metadata import NAMESPACE  # noqa: E402
from vmcache.host.files import file_stem  # noqa: E402

from tests.live import livelib  # noqa: E402
from tests.procutil import open_files  # noqa: E402
from tests.live.livelib import REPO, GiB, LiveEnv, MiB, agents_env, nbd_dir, qemu_pid, scrape, wait_for  # noqa: E402
from tests.live.guestlib import (guest_write, leftovers, pivot_when_ready, qmp, read_until_pinned,  # noqa: E402
                                 write_until_pinned)

pytestmark = pytest.mark.live

PREFIX = f"vmcache-test-rel-{os.getpid()}-"
INTERVAL = 1.0


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no MemAvailable")


@pytest.fixture(scope="module")
def env(live_tmp: Path, hooked) -> Iterator[LiveEnv]:
    yield from agents_env(live_tmp, hooked, PREFIX, cap="256M")


@pytest.fixture
def cleanup(env: LiveEnv) -> Iterator[list[str]]:
    """Names of the domains a test made (env.domain adds them): destroyed afterwards, their agents waited for."""
    yield env.made
    env.cleanup()


def running(env: LiveEnv, name: str, timeout: float = 30.0) -> dict:
    try:
        return wait_for(lambda: (s := env.status(name)) and s["state"] in ("running", "backing-off") and s,
                        f"the agent of {name} to run a cycle", timeout=timeout)
    except AssertionError as err:
        raise AssertionError(f"{err}; status {env.status(name)}; agent log:\n{env.agent_log(name)[-2000:]}"
                             f"\nhook log:\n{env.hook_log()[-1500:]}") from None


# -- memory pressure -------------------------------------------------------------------------


@contextmanager
def memory_eater(nbytes: int, cgroup_limit: int) -> Iterator[subprocess.Popen]:
    """A process holding ``nbytes`` of anonymous memory, in a memory cgroup (v1) capped at ``cgroup_limit``.

    The cap bounds it whatever happens: past it the kernel kills the eater,
    never anything else. Removed (process and cgroup) on exit.
    """
    cg = Path(f"/sys/fs/cgroup/memory/{PREFIX}eater")
    cg.mkdir()
    proc = None
    try:
        (cg / "memory.limit_in_bytes").write_text(str(cgroup_limit))
        code = ("import os,sys\n"
                f"b = bytearray({nbytes})\n"
                f"for i in range(0, {nbytes}, 4096): b[i] = 1\n"
                "sys.stdout.write('ready\\n'); sys.stdout.flush(); sys.stdin.read()\n")
        proc = subprocess.Popen(
            ["/bin/sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$0" -c "$1"', sys.executable, code],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "ready", f"eater did not get its memory (exit {proc.poll()})"
        yield proc
    finally:
        if proc is not None:
            proc.kill()
            proc.wait(timeout=30)
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def _pressure_removals(log: str) -> list[tuple[int, int]]:
    return [(int(m.group(1)), int(m.group(2)))
            for m in re.finditer(r"pin\.remove start=(\d+) length=(\d+) reason=pressure", log)]


def test_memavailable_under_the_floor_releases_lowest_priority_first_then_pins_return(env: LiveEnv, cleanup) -> None:
    """A memory eater (in a capped cgroup) takes MemAvailable under the floor: pins go, then come back."""
    name = PREFIX + "mem"
    avail = mem_available()
    if avail < 6 * GiB:
        pytest.skip("needs 6 GiB available to squeeze safely")
    # MemAvailable ends ~2 GiB under the floor, bounded by a 2.75 GiB cgroup: the other processes of a shared
    # host (another agent's pins, a VM starting or ending) move it by less than that meanwhile
    floor = avail - 512 * MiB
    eat = 5 * GiB // 2
    with env.config_override(min_free=floor):
        dom = env.domain(name, budget="32M")
        qpid = qemu_pid(name)
        running(env, name)
    # A big region (high priority) and a small one (low priority), apart.
    write_until_pinned(dom, 0, 16 * MiB, lambda: env.pinned(name), "both regions to be pinned",
                       more=[(48 * MiB, 2 * MiB)])
    if mem_available() < floor + 256 * MiB:
        pytest.skip("host memory moved too much under the test to squeeze it precisely")
    with memory_eater(eat, eat + 256 * MiB):
        squeezed = env.status(name)["disks"][0]["cycles"]
        assert mem_available() < floor
        guest_write(dom, 0, 16 * MiB)  # the guest keeps the regions hot
        wait_for(lambda: env.pinned(name) == 0, "pins to be released under pressure", timeout=10 * INTERVAL + 10)
        # Counted in the agent's cycles, not seconds (a loaded host stretches seconds): the cycle
        # running at the squeeze may have read MemAvailable before it, the next two must release.
        took = env.status(name)["disks"][0]["cycles"] - squeezed
        assert took <= 3, f"released after {took} cycles"
        assert env.status(name)["state"] == "backing-off"
        removals = _pressure_removals(env.agent_log(name))
        assert removals, env.agent_log(name)[-3000:]
        # The small (low priority) region goes first.
        assert removals[0][0] >= 40 * MiB, removals
        time.sleep(2 * INTERVAL)
        assert env.pinned(name) == 0  # nothing new pinned while under the floor
    # The eater's 2 GiB are back; the check needs the host itself back over the floor.
    try:
        wait_for(lambda: mem_available() >= floor + 64 * MiB, "MemAvailable back over the floor", timeout=15)
    except AssertionError:
        pytest.skip(f"host memory stayed under the floor after the eater left ({mem_available()} < {floor})")
    write_until_pinned(dom, 0, 16 * MiB, lambda: env.pinned(name), "pins to come back once the eater is gone",
                       timeout=15, more=[(48 * MiB, 2 * MiB)], at_least=16 * MiB)
    # QEMU was never killed: same process, domain still there.
    assert qemu_pid(name) == qpid and os.path.exists(f"/proc/{qpid}")
    assert env.lookup(name).isActive()


# The instrumented agent: `vmcache agent` with PSI read from a file the test
# writes, and every QMP command it sends (through libvirt) recorded.
_INSTRUMENTED = """
import functools, json, sys
import libvirt_qemu
from vmcache.host.meminfo import read_pressure
import vmcache.service.app
psi, record = {psi!r}, {record!r}
vmcache.service.app.read_pressure = functools.partial(read_pressure, psi)  # the composition root's PSI reader
_send = libvirt_qemu.qemuMonitorCommand
def send(dom, cmd, flags):
    with open(record, "a") as f:
        f.write(cmd.replace("\\n", " ") + "\\n")
    return _send(dom, cmd, flags)
libvirt_qemu.qemuMonitorCommand = send
from vmcache.cli import main
sys.exit(main(["agent", *sys.argv[1:]]))
"""

_PSI = "some avg10={:.2f} avg60=0.00 avg300=0.00 total=1\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=1\n"


def instrumented(env: LiveEnv, tag: str) -> tuple[Path, Path, list[str]]:
    psi, record = env.tmp / f"psi-{tag}", env.tmp / f"qmp-{tag}.jsonl"
    psi.write_text(_PSI.format(0))
    return psi, record, [sys.executable, "-c", _INSTRUMENTED.format(psi=str(psi), record=str(record))]


def test_memory_psi_over_the_threshold_shrinks_pins_within_two_cycles_and_they_return(env: LiveEnv, cleanup) -> None:
    name = PREFIX + "psi"
    psi, _record, command = instrumented(env, "psi")
    with env.config_override(agent_command=command, psi_threshold=30):
        dom = env.domain(name, budget="16M")
        running(env, name)
    write_until_pinned(dom, 0, 32 * MiB, lambda: env.pinned(name), "the budget to be pinned", at_least=12 * MiB)
    full = env.pinned(name)
    psi.write_text(_PSI.format(25.0))  # over the default 10 %, under the configured 30 %: no back-off
    time.sleep(2 * INTERVAL + 0.5)
    assert env.pinned(name) >= full * 3 // 4 and "psi.share" not in env.agent_log(name)
    psi.write_text(_PSI.format(40.0))
    pressed = time.monotonic()
    wait_for(lambda: 0 <= env.pinned(name) <= full // 2, "pins to shrink under PSI", timeout=2 * INTERVAL + 1.5)
    assert time.monotonic() - pressed <= 2 * INTERVAL + 1.5
    assert env.status(name)["state"] == "backing-off"
    wait_for(lambda: env.pinned(name) == 0, "pins to go while PSI stays high", timeout=8 * INTERVAL)
    assert "psi.share" in env.agent_log(name)
    psi.write_text(_PSI.format(0.5))
    write_until_pinned(dom, 0, 32 * MiB, lambda: env.pinned(name), "pins to come back once PSI is low",
                       timeout=10 * INTERVAL, at_least=8 * MiB)


# -- agent crash, libvirtd restart -------------------------------------------------------------


def restart_libvirtd(env: LiveEnv) -> None:
    """Stop libvirtd (SIGTERM; running domains stay) and start it again; reconnect ``env``."""
    try:
        env.conn.close()
    except libvirt.libvirtError:
        pass
    env.conn = None
    livelib.restart_libvirtd()
    env.live()  # the connection opened before the restart is dead


def storage_node(dom) -> str:
    """The storage node of vda (the node our bitmaps are on)."""
    for node in qmp(dom, "query-named-block-nodes", {"flat": True}):
        if node["drv"] == "file" and node["node-name"].startswith("libvirt-") and node["file"].endswith(".raw"):
            return node["node-name"]
    raise AssertionError("no storage node")


def written_total(env: LiveEnv, name: str) -> float:
    return scrape(env.status(name)["metrics_url"], "vmcache_guest_dirtied_bytes_total")


def test_killed_agent_comes_back_on_the_reconnect_hook_call_and_cleans_up_while_others_reconnect(
        env: LiveEnv, cleanup) -> None:
    """kill -9 one agent mid-cycle (its NBD server left up, as if killed mid-read); restart libvirtd.

    The ``reconnect`` hook call brings the killed agent back, which removes
    the stale bitmaps and server and carries on; the other agent keeps its
    pins through the restart and reconnects; both VMs run throughout.
    """
    from vmcache.host.files import short_name

    crash, survivor = PREFIX + "crash", PREFIX + "survivor"
    doms = {n: env.domain(n, budget="16M") for n in (crash, survivor)}
    qpids = {n: qemu_pid(n) for n in doms}
    for n, dom in doms.items():
        running(env, n)
        write_until_pinned(dom, 0, 8 * MiB, functools.partial(env.pinned, n), f"pins of {n}")
    survivor_pid = env.agent_pid(survivor)
    old_pid = env.agent_pid(crash)
    assert old_pid is not None
    stale = leftovers(doms[crash])["bitmaps"]
    assert stale

    # kill -9 right after a write, while the agent cycles; then leave its NBD
    # server up, as a kill between nbd-server-start and block-export-add would.
    guest_write(doms[crash], 16 * MiB, 1 * MiB)
    os.kill(old_pid, signal.SIGKILL)
    wait_for(lambda: env.agent_pid(crash) is None, "the killed agent to be gone")
    node = storage_node(doms[crash])
    sock = nbd_dir(env.run, crash) / f"nbd-{short_name(node)}.sock"
    if not sock.exists():
        qmp(doms[crash], "nbd-server-start", {"addr": {"type": "unix", "data": {"path": str(sock)}}})
    assert env.pinned(survivor) >= 8 * MiB

    restart_libvirtd(env)
    doms = {n: env.lookup(n) for n in doms}
    assert "op=reconnect" in wait_for(lambda: "op=reconnect" in env.hook_log() and env.hook_log(), "reconnect hook")

    new_pid = wait_for(lambda: env.agent_pid(crash), "the reconnect hook to restart the killed agent", timeout=20)
    assert new_pid != old_pid
    wait_for(lambda: (s := env.status(crash)) and s["pid"] == new_pid and s["state"] == "running",
             "the new agent's first cycle")
    left = leftovers(doms[crash])
    assert not set(stale) & set(left["bitmaps"]), left   # the dead agent's bitmaps are gone
    assert len(left["bitmaps"]) == 1 and left["exports"] == [], (left, env.agent_log(crash)[-4000:])
    before = written_total(env, crash)
    guest_write(doms[crash], 32 * MiB, 4 * MiB)
    wait_for(lambda: written_total(env, crash) - before >= 4 * MiB, "the new agent to see writes (not deferred)",
             timeout=10)
    write_until_pinned(doms[crash], 32 * MiB, 4 * MiB, lambda: env.pinned(crash), "the new agent to pin")

    # The survivor kept its process and pins and reconnected.
    assert env.agent_pid(survivor) == survivor_pid
    wait_for(lambda: "agent.reconnected" in env.agent_log(survivor), "the survivor to reconnect")
    assert "agent.libvirt_lost" in env.agent_log(survivor)
    before = written_total(env, survivor)
    guest_write(doms[survivor], 40 * MiB, 2 * MiB)
    wait_for(lambda: written_total(env, survivor) - before >= 2 * MiB, "the survivor to track writes again")
    assert env.pinned(survivor) >= 2 * MiB
    # VMs ran throughout.
    for n in doms:
        assert qemu_pid(n) == qpids[n] and doms[n].isActive()


# -- a libvirt pull-mode backup ---------------------------------------------------------------


def backup_begin(dom, xml: str) -> int:
    """virDomainBackupBegin; retried when it meets the agent's NBD server (up a few ms per cycle).

    Returns how many attempts met it (see docs/reliability.md).
    """
    for attempt in range(5):
        try:
            dom.backupBegin(xml, None, 0)
            return attempt
        except libvirt.libvirtError as err:
            if "already running" not in str(err) or attempt == 4:
                raise
            time.sleep(0.2)
    raise AssertionError("unreachable")


def _settled(url: str, metric: str) -> float | None:
    """``metric`` if it did not move over two cycles: a write still in flight has been counted."""
    first = scrape(url, metric)
    time.sleep(2 * INTERVAL)
    return first if scrape(url, metric) == first else None


def test_pull_backup_reads_correct_data_while_the_agent_defers_and_loses_no_write(env: LiveEnv, cleanup) -> None:
    import nbd

    name = PREFIX + "backup"
    dom = env.domain(name, budget="16M")
    running(env, name)
    write_until_pinned(dom, 0, 4 * MiB, lambda: env.pinned(name), pattern=0x11)
    url = env.status(name)["metrics_url"]
    written = wait_for(functools.partial(_settled, url, "vmcache_guest_dirtied_bytes_total"),
                       "the last write before the backup to be counted")
    deferred = scrape(url, "vmcache_bitmap_reads_total", {"result": "deferred"})
    sock, scratch = env.tmp / "backup.sock", env.tmp / "backup-scratch.qcow2"
    xml = (f"<domainbackup mode='pull'><server transport='unix' socket='{sock}'/><disks>"
           f"<disk name='vda' backup='yes' type='file'><scratch file='{scratch}'/></disk></disks></domainbackup>")
    backup_begin(dom, xml)
    try:
        # The guest writes during the backup: over backed-up data and elsewhere.
        guest_write(dom, 0, 1 * MiB, pattern=0x22)
        guest_write(dom, 8 * MiB, 2 * MiB, pattern=0x33)
        wait_for(lambda: scrape(url, "vmcache_bitmap_reads_total", {"result": "deferred"}) >= deferred + 2,
                 "the agent to defer its reads during the backup")
        handle = nbd.NBD()
        handle.set_export_name("vda")
        handle.connect_unix(str(sock))
        try:
            assert handle.get_size() == 64 * MiB
            assert handle.pread(4 * MiB, 0) == b"\x11" * (4 * MiB)   # as at backup start
            assert handle.pread(2 * MiB, 8 * MiB) == bytes(2 * MiB)
        finally:
            handle.shutdown()
        assert scrape(url, "vmcache_guest_dirtied_bytes_total") == written  # nothing read yet: deferred
        assert env.agent_pid(name)
    finally:
        dom.abortJob()
    # After the backup: exactly the 3 MiB written during it, no more, no less.
    wait_for(lambda: scrape(url, "vmcache_guest_dirtied_bytes_total") > written, "the deferred read", timeout=10)
    assert scrape(url, "vmcache_guest_dirtied_bytes_total") - written == 3 * MiB
    assert scrape(url, "vmcache_bitmap_reads_total", {"result": "failed"}) == 0
    left = leftovers(dom)   # the agent's own active bitmap and its view node, nothing else
    assert len(left["bitmaps"]) == 1 and left["exports"] == [] and len(left["nodes"]) <= 1, left
    assert not sock.exists()


def _persistent_qcow2(env: LiveEnv, name: str) -> Any:
    """A persistent opted-in domain on a 64 MiB qcow2 image (internal snapshots and checkpoints need both)."""
    image = env.tmp / f"{name}.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(image), "64M"], check=True)
    return env.domain(name, image=image, persistent=True, edit=lambda xml: xml.replace("type='raw'", "type='qcow2'"))


def _job_done(dom: Any) -> bool:
    return dom.jobInfo()[0] == libvirt.VIR_DOMAIN_JOB_NONE


def test_checkpoint_incremental_push_backup_and_internal_snapshot_revert_succeed_beside_the_agent(
        env: LiveEnv, cleanup) -> None:
    name = PREFIX + "intsnap"
    dom = _persistent_qcow2(env, name)
    try:
        running(env, name)
        pid = env.agent_pid(name)
        # qcow2: a cluster never written reads as zeros, without the file; the first block, shared with the
        # metadata and read in part, may stay under the threshold
        guest_write(dom, 0, 4 * MiB)
        read_until_pinned(dom, 0, 4 * MiB, lambda: env.pinned(name), at_least=3 * MiB)

        dom.checkpointCreateXML("<domaincheckpoint><name>c1</name></domaincheckpoint>", 0)
        guest_write(dom, 8 * MiB, 4 * MiB)
        target = env.tmp / f"{name}-inc.qcow2"
        dom.backupBegin(f"<domainbackup><incremental>c1</incremental><disks><disk name='vda' type='file'>"
                        f"<target file='{target}'/><driver type='qcow2'/></disk></disks></domainbackup>", None, 0)
        wait_for(lambda: _job_done(dom), "the backup to finish")
        stats = dom.jobStats(libvirt.VIR_DOMAIN_JOB_STATS_COMPLETED)
        assert stats.get("type") == libvirt.VIR_DOMAIN_JOB_COMPLETED, stats
        assert target.exists()
        dom.checkpointLookupByName("c1").delete(0)
        assert env.agent_pid(name) == pid

        dom.snapshotCreateXML("<domainsnapshot><name>s1</name></domainsnapshot>", 0)   # internal, with memory
        guest_write(dom, 16 * MiB, 4 * MiB)
        dom.revertToSnapshot(dom.snapshotLookupByName("s1", 0), libvirt.VIR_DOMAIN_SNAPSHOT_REVERT_PAUSED)
        wait_for(lambda: (p := env.agent_pid(name)) and p != pid, "the reverted run's agent")
        running(env, name)
        guest_write(dom, 24 * MiB, 4 * MiB)
        read_until_pinned(dom, 24 * MiB, 4 * MiB, lambda: env.pinned(name), "a pin in the reverted run",
                          at_least=3 * MiB)
        dom.snapshotLookupByName("s1", 0).delete(0)
        left = leftovers(dom)   # the agent's own bitmap and at most its view node
        assert len(left["bitmaps"]) == 1 and left["exports"] == [] and len(left["nodes"]) <= 1, left
        log = env.agent_log(name)
        assert "Traceback" not in log and "cycle_failed" not in log and "read_failed" not in log, log[-3000:]
    finally:
        if dom.isActive():
            dom.destroy()
        wait_for(lambda: env.agent_pid(name) is None, "the agent to exit")
        dom.undefineFlags(libvirt.VIR_DOMAIN_UNDEFINE_SNAPSHOTS_METADATA
                          | libvirt.VIR_DOMAIN_UNDEFINE_CHECKPOINTS_METADATA)


# -- disks that grow, are replaced, unplugged; domains destroyed --------------------------------


def _disk_status(env: LiveEnv, name: str, target: str) -> Any:
    s = env.status(name)
    return next((d for d in s["disks"] if d["target"] == target), None) if s else None


def _pinned_on(env: LiveEnv, name: str, target: str) -> int:
    """Bytes pinned on disk ``target`` (0 while the agent does not list it)."""
    d = _disk_status(env, name, target)
    return d["pinned_bytes"] if d else 0


def test_disk_growth_raw_resize_and_qcow2_allocation_resize_the_maps(env: LiveEnv, cleanup) -> None:
    name = PREFIX + "grow"
    qcow = env.tmp / "grow.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(qcow), "256M"], check=True)
    vdb = (f"<disk type='file' device='disk'><driver name='qemu' type='qcow2' cache='writethrough'/>"
           f"<source file='{qcow}'/><target dev='vdb' bus='virtio'/><alias name='ua-vdb'/></disk>")
    dom = env.domain(name, budget="64M", size=32 * MiB, devices=vdb)
    running(env, name)
    pid = env.agent_pid(name)
    url = env.status(name)["metrics_url"]
    write_until_pinned(dom, 0, 2 * MiB, functools.partial(_pinned_on, env, name, "vda"), "a pin on vda")

    dom.blockResize("vda", 96 * MiB, libvirt.VIR_DOMAIN_BLOCK_RESIZE_BYTES)
    guest_write(dom, 80 * MiB, 8 * MiB)                     # past the old end
    small = qcow.stat().st_size
    guest_write(dom, 100 * MiB, 8 * MiB, dev="ua-vdb")      # qcow2 allocates: the file grows
    assert qcow.stat().st_size >= small + 8 * MiB
    wait_for(lambda: scrape(url, "vmcache_image_size_bytes", {"target_device": "vda"}) == 96 * MiB, "vda's maps to grow")
    wait_for(lambda: scrape(url, "vmcache_image_size_bytes", {"target_device": "vdb"}) == qcow.stat().st_size,
             "vdb's maps to follow the file")
    # what the guest wrote past the old ends and reads back is pinned (the counted reads decide)
    read_until_pinned(dom, 80 * MiB, 8 * MiB, lambda: _disk_status(env, name, "vda")["pinned_bytes"],
                      "the new region of vda pinned")
    read_until_pinned(dom, 100 * MiB, 8 * MiB, lambda: _disk_status(env, name, "vdb")["pinned_bytes"],
                      "the new clusters of vdb pinned", dev="ua-vdb", at_least=7 * MiB)  # but the metadata's block
    # The writes past the old end were tracked (bitmaps grow with the node).
    assert scrape(url, "vmcache_guest_dirtied_bytes_total", {"target_device": "vda"}) >= 10 * MiB
    assert env.agent_pid(name) == pid
    log = env.agent_log(name)
    assert "Traceback" not in log and "cycle_failed" not in log and "read_failed" not in log, log[-3000:]


def test_replaced_image_blockcopy_pivot_is_followed_without_crash(env: LiveEnv, cleanup) -> None:
    name = PREFIX + "replace"
    dom = env.domain(name, budget="16M", size=32 * MiB)
    running(env, name)
    pid = env.agent_pid(name)
    write_until_pinned(dom, 0, 2 * MiB, lambda: env.pinned(name))
    copy = env.tmp / "replace-copy.raw"
    dom.blockCopy("vda", f"<disk type='file'><source file='{copy}'/><driver type='raw'/></disk>", None, 0)
    pivot_when_ready(dom, "vda")
    guest_write(dom, 8 * MiB, 4 * MiB)
    wait_for(lambda: (d := _disk_status(env, name, "vda")) and d["source"] == str(copy) and not d["error"],
             "the agent to follow the new image", timeout=15)
    read_until_pinned(dom, 8 * MiB, 4 * MiB, lambda: _disk_status(env, name, "vda")["pinned_bytes"],
                      "a pin on the new image", timeout=15)
    assert env.agent_pid(name) == pid
    maps = Path(f"/proc/{pid}/maps").read_text()
    assert str(copy) in maps and f"{file_stem(name)}.raw" not in maps


def test_hot_unplugged_disk_is_dropped_cleanly_and_hotplugged_one_managed(env: LiveEnv, cleanup) -> None:
    name = PREFIX + "unplug"
    extra = env.tmp / "unplug-sda.raw"
    with open(extra, "wb") as f:
        f.truncate(32 * MiB)
    dom = env.domain(name, budget="32M", devices="<controller type='scsi' model='virtio-scsi'/>")
    running(env, name)
    pid = env.agent_pid(name)
    assert pid is not None
    sda = (f"<disk type='file' device='disk'><driver name='qemu' type='raw' cache='writethrough'/>"
           f"<source file='{extra}'/><target dev='sda' bus='scsi'/><alias name='ua-sda'/></disk>")
    dom.attachDeviceFlags(sda, libvirt.VIR_DOMAIN_AFFECT_LIVE)
    wait_for(lambda: (d := _disk_status(env, name, "sda")) and d["eligible"] and d["last_cycle_at"],
             "the hotplugged disk to be managed")
    assert len(leftovers(dom)["bitmaps"]) == 2
    write_until_pinned(dom, 0, 2 * MiB, functools.partial(_pinned_on, env, name, "vda"), "a pin on vda")
    dom.detachDeviceFlags(sda, libvirt.VIR_DOMAIN_AFFECT_LIVE)
    wait_for(lambda: _disk_status(env, name, "sda") is None, "the unplugged disk to be dropped")
    assert env.agent_pid(name) == pid
    fds = open_files(pid)
    assert str(extra) not in fds and str(extra) not in Path(f"/proc/{pid}/maps").read_text()
    assert len(leftovers(dom)["bitmaps"]) == 1
    before = written_total(env, name)
    guest_write(dom, 16 * MiB, 1 * MiB)
    wait_for(lambda: written_total(env, name) - before >= 1 * MiB, "vda still tracked")
    assert "Traceback" not in env.agent_log(name)


def test_an_idle_disk_hotplugged_beside_a_hot_one_does_not_cut_the_hot_ones_pins(env: LiveEnv, cleanup) -> None:
    """The domain budget goes where the heat is: a read-only disk nobody reads takes none of it from vda."""
    name = PREFIX + "idleplug"
    extra = env.tmp / "idleplug-sda.raw"
    with open(extra, "wb") as f:
        f.truncate(32 * MiB)
    dom = env.domain(name, budget="32M", size=64 * MiB, devices="<controller type='scsi' model='virtio-scsi'/>")
    running(env, name)
    pid = env.agent_pid(name)
    write_until_pinned(dom, 0, 28 * MiB, functools.partial(_pinned_on, env, name, "vda"), "vda's hot 28 MiB pinned", at_least=24 * MiB)
    sda = (f"<disk type='file' device='disk'><driver name='qemu' type='raw' cache='writethrough'/>"
           f"<source file='{extra}'/><target dev='sda' bus='scsi'/><readonly/><alias name='ua-sda'/></disk>")
    dom.attachDeviceFlags(sda, libvirt.VIR_DOMAIN_AFFECT_LIVE)
    wait_for(lambda: (d := _disk_status(env, name, "sda")) and d["eligible"] and d["last_cycle_at"],
             "the hotplugged disk to be managed")
    lowest = _disk_status(env, name, "vda")["pinned_bytes"]
    for _ in range(8):  # a few 1 s cycles, vda kept hot
        guest_write(dom, 0, 28 * MiB)
        time.sleep(1)
        lowest = min(lowest, _disk_status(env, name, "vda")["pinned_bytes"])
    assert lowest >= 24 * MiB, f"vda's pins fell to {lowest} B when an idle disk was plugged in"
    assert _disk_status(env, name, "sda")["pinned_bytes"] == 0
    assert env.status(name)["budget_bytes"] == 32 * MiB  # the domain's budget, not the sum of the disks' caps
    assert env.agent_pid(name) == pid and "Traceback" not in env.agent_log(name)


def test_domain_destroyed_mid_cycle_the_agent_exits_cleanly_leaving_nothing(env: LiveEnv, cleanup) -> None:
    names = [PREFIX + f"destroy{i}" for i in range(2)]
    doms = [env.domain(n, budget="16M") for n in names]
    for n in names:
        running(env, n)
    for n, dom in zip(names, doms):
        write_until_pinned(dom, 0, 8 * MiB, functools.partial(env.pinned, n), f"{n}'s pins")
    # Destroy while the agents are busy: right after a large write, at different points of their cycles.
    for i, dom in enumerate(doms):
        guest_write(dom, 16 * MiB, 32 * MiB)
        time.sleep(0.35 * i)
        dom.destroy()
    for n in names:
        wait_for(lambda n=n: env.agent_pid(n) is None, f"agent of {n} to exit")
        log = env.agent_log(n)
        assert "agent.stopped" in log and "agent.failed" not in log and "Traceback" not in log, log[-2000:]
        assert env.status(n) is None
        assert not nbd_dir(env.run, n).exists()
        assert not (env.run / "prometheus" / f"{file_stem(n)}.json").exists()
        assert n not in (env.run / "ledger.json").read_text()


# -- bad input ---------------------------------------------------------------------------------


def _hook_xml(name: str, metadata: str, disk: str = "/nonexistent.raw") -> str:
    from xml.sax.saxutils import escape

    return (f"<domain type='qemu'><name>{escape(name)}</name><uuid>{uuidlib.uuid4()}</uuid>{metadata}"
            f"<devices><disk type='file' device='disk'><driver name='qemu' type='raw' cache='writethrough'/>"
            f"<source file='{disk}'/><target dev='vda' bus='virtio'/></disk></devices></domain>")


_WRITE_CALL = re.compile(r'^\d+\s+(openat|open|creat|mkdir|mkdirat|rename|renameat2?|unlink|unlinkat|symlink|link|'
                         r'truncate|chmod|fchmodat)\((.*)$')


def _written_paths(trace: Path) -> set[str]:
    """Paths the traced processes created, wrote, renamed, removed or changed (strace -f output)."""
    out = set()
    for line in trace.read_text(errors="replace").splitlines():
        m = _WRITE_CALL.match(line)
        if not m or "= -1" in line:
            continue
        call, args = m.groups()
        if call in ("openat", "open") and not re.search(r"O_WRONLY|O_RDWR|O_CREAT|O_TRUNC", args):
            continue
        out.update(re.findall(r'"((?:[^"\\]|\\.)*)"', args))
    return out


def _inside(path: str, dirs: tuple[str, ...]) -> bool:
    """True if ``path`` is one of ``dirs`` or under one of them."""
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs)


def run_hook_traced(env: LiveEnv, args: list[str], xml: str | bytes, config: Path, trace: Path) -> subprocess.CompletedProcess:
    data = xml.encode() if isinstance(xml, str) else xml
    return subprocess.run(
        ["strace", "-f", "-qq", "-o", str(trace), "-e",
         "trace=open,openat,creat,mkdir,mkdirat,rename,renameat,renameat2,unlink,unlinkat,symlink,link,truncate,"
         "chmod,fchmodat",
         sys.executable, "-I", "-B", "-m", "vmcache.service.hook", "--config", str(config), *args],
        input=data, capture_output=True, timeout=60, cwd="/")


def test_hostile_input_gives_one_line_errors_exit_0_and_writes_only_in_vmcache_dirs(env: LiveEnv, cleanup) -> None:
    bomb = ("<?xml version='1.0'?><!DOCTYPE d [<!ENTITY a 'aaaaaaaaaa'><!ENTITY b '&a;&a;&a;&a;&a;&a;&a;&a;'>"
            "<!ENTITY c '&b;&b;&b;&b;&b;&b;&b;&b;'>]>")
    meta = "<metadata><vmcache:cache xmlns:vmcache='" + NAMESPACE + "' {}</metadata>"
    cases = {
        "negative": meta.format("budget='-1G'/>"),
        "huge": meta.format("budget='99999999999999T'/>"),
        "parsecs": meta.format("budget='12 parsecs'/>"),
        "unknown": meta.format("budget='1G'><vmcache:evil cmd='rm -rf /'/></vmcache:cache>"),
        "attr": meta.format("budget='1G' exec='/bin/sh'/>"),
    }
    # Through libvirt: every such domain starts, and gets no agent.
    for tag, metadata in cases.items():
        name = PREFIX + "bad-" + tag
        dom = env.domain(name, metadata=metadata)
        assert dom.isActive()
    for tag in cases:
        name = PREFIX + "bad-" + tag
        line = wait_for(lambda n=name: next((ln for ln in env.hook_log().splitlines()
                                             if f"domain={n} " in ln and "hook.ignore" in ln), None),
                        f"the hook's reason for {name}")
        assert "unusable XML or metadata" in line, line
        assert env.agent_pid(name) is None
    # Names with spaces, quotes, unicode: the agent runs, files are named safely.
    odd = PREFIX + "sp ace 'q\"uote' ünï☃"
    env.domain(odd, budget="1048576")   # a unit-less budget is bytes
    status = running(env, odd)
    assert status["domain"] == odd and status["disks"][0]["budget_bytes"] == 1 * MiB
    assert all("/" not in p.name and " " not in p.name for p in env.agents.iterdir())

    # Straight through the hook (what libvirt would not pass): entity expansion, a slash, bad YAML.
    hook_tmp = env.tmp / "hook-sandbox"
    hook_tmp.mkdir()
    bad_yaml = hook_tmp / "bad.yaml"
    bad_yaml.write_text("budget: [1G\nruntime_dir: /etc\n")
    good = hook_tmp / "good.yaml"
    good.write_text(yaml.safe_dump({**env.base, "runtime_dir": f"{hook_tmp}/run", "log_dir": f"{hook_tmp}/log"}))
    calls: list[tuple[list[str], str | bytes, Path]] = [
        ([PREFIX + "bomb", "started", "begin", "-"],
         bomb + _hook_xml(PREFIX + "bomb", meta.format("budget='&c;'/>")), good),
        ([PREFIX + "x/../../../etc/vmcache-owned", "started", "begin", "-"],
         _hook_xml(PREFIX + "x/../../../etc/vmcache-owned", meta.format("budget='1M'/>")), good),
        ([PREFIX + "yaml", "started", "begin", "-"], _hook_xml(PREFIX + "yaml", meta.format("budget='1M'/>")),
         bad_yaml),
        ([PREFIX + "bin", "started", "begin", "-"], b"\xff\xfe<domain>\x00", good),
    ]
    for i, (args, xml, config) in enumerate(calls):
        trace = hook_tmp / f"trace-{i}"
        started = time.monotonic()
        done = run_hook_traced(env, args, xml, config, trace)
        assert done.returncode == 0 and time.monotonic() - started < 20, done.stderr
        time.sleep(2)  # an agent the slash name started fails to find its domain and exits
        # vmcache's own: the configured directories and the hook's config cache, or the default
        # directories when the config is unusable - each with the directory itself, which the hook
        # creates on a machine that never ran vmcache (/run is empty after every boot).
        own = ((str(hook_tmp), CACHE_DIR) if config is good
               else (str(hook_tmp), "/var/log/vmcache", "/run/vmcache"))
        made = (os.path.dirname(CACHE_DIR),) if config is good else ()  # mkdir'ed on the way to the cache
        outside = {p for p in _written_paths(trace)
                   if not _inside(p, own) and p not in made and p not in ("/dev/null", "/dev/tty")}
        assert not outside, (args[0], outside)
    log = (hook_tmp / "log" / "hook.log").read_text()
    lines = [ln for ln in log.splitlines() if "hook." in ln]
    assert any("bomb" in ln and "unusable XML" in ln for ln in lines), log
    default_log = Path("/var/log/vmcache/hook.log")
    default_lines = default_log.read_text(errors="replace").splitlines() if default_log.exists() else []
    assert any(PREFIX + "yaml" in ln and "host config" in ln and "invalid YAML" in ln for ln in default_lines)
    assert not Path("/etc/vmcache-owned").exists()
    for ln in log.splitlines():   # one line per event: a continuation line would not start with the date
        assert re.match(r"^\d{4}-\d\d-\d\d ", ln), ln


# -- security ----------------------------------------------------------------------------------


def test_security_loopback_metrics_root_only_sockets_own_disks_only_and_allowed_qmp_only(env: LiveEnv, cleanup) -> None:
    name = PREFIX + "sec"
    _psi, record, command = instrumented(env, "sec")
    other = env.tmp / "not-a-disk-of-this-domain.raw"
    other.write_bytes(b"\0" * 4096)
    with env.config_override(agent_command=command):
        dom = env.domain(name, budget="16M")
        running(env, name)
    pid = env.agent_pid(name)
    assert pid is not None
    write_until_pinned(dom, 0, 4 * MiB, lambda: env.pinned(name))
    status = env.status(name)
    # Metrics on loopback (the default listen address).
    port = int(status["metrics_url"].rsplit(":", 1)[1].split("/")[0])
    assert status["metrics_url"].startswith("http://127.0.0.1:")
    listening = [ln.split() for ln in Path("/proc/net/tcp").read_text().splitlines()[1:]
                 + Path("/proc/net/tcp6").read_text().splitlines()[1:]]
    ours = [f[1] for f in listening if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port]
    assert ours == ["0100007F:" + f"{port:04X}"], ours
    # The NBD socket directory is root's only.
    nbd = nbd_dir(env.run, name)
    info = nbd.stat()
    assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == 0
    # Mapped and opened: only the domain's own image (besides Python's libraries).
    image = str(env.tmp / f"{file_stem(name)}.raw")
    mapped = {ln.split(None, 5)[5] for ln in Path(f"/proc/{pid}/maps").read_text().splitlines()
              if len(ln.split(None, 5)) == 6 and ln.split(None, 5)[5].startswith("/")}
    assert {p for p in mapped if p.startswith(str(env.tmp))} == {image}
    assert not {p for p in mapped if not p.startswith(("/usr/", "/lib", str(REPO), "/etc/ld.so", "/tmp/pytest", "/dev/"))
                and not p.endswith((".so", ".cache"))} - {image}
    opened = open_files(pid)
    assert str(other) not in opened and image in opened
    # Only the allow-listed QMP commands were ever sent.
    dom.destroy()
    wait_for(lambda: env.agent_pid(name) is None, "the agent to exit")
    sent = [json.loads(line) for line in record.read_text().splitlines()]
    assert sent
    commands = {m["execute"] for m in sent}
    assert commands <= ALLOWED_COMMANDS, commands - ALLOWED_COMMANDS
    actions = {a["type"] for m in sent if m["execute"] == "transaction" for a in m["arguments"]["actions"]}
    assert actions <= TRANSACTION_ACTIONS
    assert {"block-dirty-bitmap-add", "nbd-server-start", "block-export-add"} <= commands | actions
