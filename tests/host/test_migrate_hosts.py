"""Live migration between two real libvirt hosts (make test-migrate).

tests/host/migrate.sh boots the hosts (two systemd-nspawn containers, each
with its own libvirtd and vmcache installed from the .deb) and runs this
module on this machine; anywhere else it is skipped. The domains are the
test guest (scripts/build-guest.sh: a Debian kernel, busybox, idle) on a
writethrough raw image in the directory both hosts mount at the same path.
Migration is what an operator (or Nova, with p2p) runs on the source:
``virsh migrate --live --p2p --persistent --undefinesource --unsafe DOMAIN
qemu+tcp://DEST/system`` (--unsafe: libvirt 9.0 does not know a bind mount
for shared storage; docs/reliability.md).

Both hosts run on this machine's one kernel, but each reaches the image
directory through its own delay device (migrate.sh): its own page cache, so
what is resident through one host's mount is what that host cached, and a
page one host cached is stale on the other after a write there. What each
agent holds is read from its own log lines and its process (VmLck), what
each QEMU read from its block statistics. What the checks share with the
benchmark (bench/migrate_bench.py) is in tests/host/migration.py.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.host.twohosts import Host, hosts_from_env, shared_from_env

HOSTS = hosts_from_env()
pytestmark = [pytest.mark.live, pytest.mark.skipif(HOSTS is None, reason="only on the hosts of make test-migrate")]

if HOSTS is not None:
    import libvirt

    from tests.host.migration import (Side, agent_running, close_sides, console, define_guest, guest_ready, lines,
                                      migrate, open_sides, resident, resume_time, status, unit_of)
    from tests.nova import nova_instance
    from tests.live.guestlib import guest_write, leftovers, qmp, read_until_pinned
    from tests.live.livelib import wait_for
    from vmcache.host.files import short_name
    from vmcache.host.virtdomain import Affect, VirtDomain
    from vmcache.settings.hotset import DiskHotSet
    from vmcache.settings.metadata import NAMESPACE

PREFIX = "mig-"
FLAVOR = "mig.large"   # the rule migrate.sh writes into both hosts' config: domains: [{match: {nova_flavor: ...}}]
RULE = f"rule 1: nova_flavor={FLAVOR}"
MiB = 1 << 20
DEV = "virtio-disk0"   # the lab guest's disk, as QEMU names the device
BUDGET = 16 * MiB
# Between B's resume event as this machine's client gets it and the journal's time of B's agent's log line
# (the agent pins only after libvirt ends the migration job, which it does after emitting the event).
SLACK = 0.25
TIMINGS = Path(os.environ.get("VMCACHE_MIGRATE_LOGS", "build/migrate")) / "timings.jsonl"


@pytest.fixture(scope="module")
def sides() -> Iterator[tuple[Side, Side]]:
    assert HOSTS is not None
    pair = open_sides(HOSTS)
    try:
        yield pair
    finally:
        close_sides(pair, PREFIX)


# -- domains and agents -----------------------------------------------------------------------


def read_ops(dom: Any) -> int:
    """Read requests the guest made through its virtio disk so far (query-blockstats; HMP qemu-io is not counted)."""
    return next(d["stats"]["rd_operations"] for d in qmp(dom, "query-blockstats") if DEV in d.get("qdev", ""))


def dirtied(host: Host, name: str) -> float:
    """vmcache_guest_dirtied_bytes_total of the domain's agent on ``host``: what its dirty-bitmap reads counted."""
    text = host.scrape(status(host, name)["metrics_url"])
    samples = [float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("vmcache_guest_dirtied_bytes_total{")]
    assert samples, text[-2000:]
    return sum(samples)


def counts_reads(host: Host, name: str) -> None:
    """The agent of ``name`` on ``host`` counts its QEMU's reads in the kernel (from the container's pid
    namespace), not inferred."""
    s = status(host, name)
    assert s["read_signal"] in ("probe", "tracepoint"), (host.name, s["read_signal"], s.get("read_signal_reason"))


def runtime_leftovers(host: Host, name: str, uuid: str) -> list[str]:
    """What of the domain's agent is still on ``host``: processes, locked memory, files, ledger entries."""
    left = [f"process {pid}: {cmd}" for pid in host.pids().values()
            if "--domain" in (cmd := _cmdline(pid)) and name in cmd]
    left += [f"pid {pid} locks {n} bytes" for pid, n in host.locked().items()]
    left += [p for p in host.files("/run/vmcache", "/run/lock/vmcache")
             if not host.path(p).is_dir() and not re.fullmatch(r"/run/vmcache/((ledger|warmup)\.json(\.lock)?|"
                                                                 r"share\.json|reconciled\.json|reconcile\.lock|"
                                                                 r"config-cache/.*)|/run/lock/vmcache/reads\.lock", p)]
    left += [p for p in ("/run/vmcache/ledger.json", "/run/vmcache/share.json", "/run/vmcache/warmup.json")
             if host.path(p).exists() and (uuid in (text := host.path(p).read_text()) or name in text)]
    if host.path(f"/run/vmcache/nbd/{short_name(name, 12)}").exists():
        left.append("its NBD socket directory")
    return left


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def record(**figures: Any) -> None:
    """One line of measured figures for docs/benchmarks.md (build/migrate/timings.jsonl)."""
    TIMINGS.parent.mkdir(parents=True, exist_ok=True)
    with TIMINGS.open("a") as f:
        f.write(json.dumps({"at": time.strftime("%Y-%m-%d %H:%M:%S"), "load": os.getloadavg()[0], **figures}) + "\n")


# -- tests ------------------------------------------------------------------------------------


def test_a_plain_domain_migrates_there_and_back(sides: tuple[Side, Side]) -> None:
    """The two hosts as such: a running domain vmcache does not manage goes to B and back, no agent anywhere."""
    a, b = sides
    name = PREFIX + "plain"
    define_guest(a, name).create()
    guest_ready(name)
    there = migrate(a, b, name)
    dom = b.conn.lookupByName(name)
    assert dom.state() == [libvirt.VIR_DOMAIN_RUNNING, libvirt.VIR_DOMAIN_RUNNING_MIGRATED]
    assert name not in [d.name() for d in a.conn.listAllDomains()]  # --undefinesource
    back = migrate(b, a, name)
    dom = a.conn.lookupByName(name)
    assert dom.state() == [libvirt.VIR_DOMAIN_RUNNING, libvirt.VIR_DOMAIN_RUNNING_MIGRATED]
    assert qmp(dom, "query-status")["status"] == "running"
    for side in sides:  # each started it once (A at its start and on the way back, B as it came in)
        assert side.host.unit(unit_of(name))["ActiveState"] == "inactive"
        hook = side.host.run("journalctl", "-b", "-q", "--no-pager", "-o", "cat", "-t", "vmcache-hook")
        assert f'hook.ignore domain={name} op=started reason="no vmcache metadata, no rule matches"' in hook, hook
    dom.destroy()
    dom.undefine()
    record(test="plain", migrate_s=round(there, 3), back_s=round(back, 3))


def saved_set(side: Side, name: str, at_least: int) -> DiskHotSet:
    """Waits for the agent to save a hot set of ``at_least`` bytes in the live XML; its record of vda."""
    def saved() -> DiskHotSet | None:
        hotset = VirtDomain(side.conn, name).hotset(Affect.LIVE)
        disk = hotset.disk("vda") if hotset else None
        return disk if disk is not None and disk.bytes >= at_least else None

    return wait_for(saved, f"the agent on {side.host.name} to save the hot set in the live XML")


def start_opted_in(a: Side, name: str, *, by_rule: bool = False) -> tuple[Any, str, DiskHotSet]:
    """``name`` defined on A, opted in by its metadata (``vmcache enable``) or, ``by_rule``, defined as Nova
    defines it (its flavor matches the hosts' rule, no element of vmcache's), started; its guest wrote two
    regions, which A's agent pinned and saved in the live XML. (A's virDomain, its uuid, the saved set of vda.)"""
    define_guest(a, name, metadata=nova_instance(flavor=FLAVOR) if by_rule else "")
    if not by_rule:
        a.host.run("vmcache", "enable", name, "--budget", "16M", "--config")
    a.host.run("virsh", "start", name)
    dom = a.conn.lookupByName(name)
    assert agent_running(a.host, name)["managed_by"] == (RULE if by_rule else "metadata")
    guest_ready(name)
    guest_write(dom, 8 * MiB, 4 * MiB, dev=DEV)
    guest_write(dom, 40 * MiB, 2 * MiB, dev=DEV)
    # read back until pinned: where the counted reads decide (the default), writes alone may cool first
    read_until_pinned(dom, 8 * MiB, 4 * MiB, lambda: (s := status(a.host, name)) and s["disks"][0]["pinned_bytes"] or 0,
                      "A's agent to pin the written regions", more=[(40 * MiB, 2 * MiB)], dev=DEV)
    carried = saved_set(a, name, 6 * MiB)
    assert carried.bytes <= BUDGET
    counts_reads(a.host, name)
    # each host its own page cache: what A's agent locked through A's mount is not on B
    assert resident(0, name, 8 * MiB, 4 * MiB) == 4 * MiB and resident(1, name, 0, 64 * MiB) == 0
    return dom, dom.UUIDString(), carried


def warm_on_b(b: Side, name: str, carried: DiskHotSet, resumed: float, *, by_rule: bool = False) -> float:
    """B's agent warmed from the set that came in the XML and locked all of it, after the domain was in
    (``resumed``: B's resume event) and before the guest read anything on B: once it is done, B's QEMU
    has served no read request of the guest yet (the counter counts every request of the virtio device
    since B's QEMU started; this guest is idle). When it was done."""
    assert agent_running(b.host, name)["managed_by"] == (RULE if by_rule else "metadata")
    done = wait_for(lambda: lines(b.host, name, "warm.done"), "B's agent to restore the carried set", timeout=60)
    assert read_ops(b.conn.lookupByName(name)) == 0
    # the live XML's set follows A's pins cycle by cycle: it may have grown since ``carried`` was read
    loaded = lines(b.host, name, "hotset.loaded")
    assert loaded and "definition=live" in loaded[0][1], loaded
    size = re.search(r" bytes=(\d+)", loaded[0][1])
    assert size, loaded
    got = int(size.group(1))
    assert got >= carried.bytes, (got, carried)
    assert f"restored={got} given_up=0 total={got}" in done[0][1], done
    counts_reads(b.host, name)
    pinned = {(int(s), int(n)) for _t, m in lines(b.host, name, "pin.add")
              for s, n in re.findall(r"start=(\d+) length=(\d+)", m)}
    for region in carried.regions:
        assert any(s <= region.start and region.start + region.length <= s + n for s, n in pinned), (region, pinned)
    first = min(t for t, _m in lines(b.host, name, "pin.add"))
    assert first >= resumed - SLACK, (first, resumed)
    assert resident(1, name, 8 * MiB, 4 * MiB) == 4 * MiB   # now in B's own page cache
    return done[0][0]


def moved_cleanly(a: Side, b: Side, name: str, uuid: str) -> None:
    """After the switch: nothing of the domain's agent on A, only B's bitmap in B's QEMU, B's writes exact."""
    nothing_left_on_a(a, name, uuid)
    one_bitmap_on_b(b, name)
    exact_writes_on_b(b, name)


def nothing_left_on_a(a: Side, name: str, uuid: str) -> None:
    """A's agent stopped cleanly once its QEMU was gone: no process, pin, file or ledger entry of it."""
    wait_for(lambda: a.host.unit(unit_of(name))["ActiveState"] == "inactive", "A's agent to stop")
    assert a.host.unit(unit_of(name))["Result"] == "success"
    assert runtime_leftovers(a.host, name, uuid) == []
    # What stays on purpose: the host's copy of the set (hotset_dir; pruned by count and age).
    kept = [p for p in a.host.files("/var/lib/vmcache") if uuid in p or name in p]
    assert set(kept) <= {f"/var/lib/vmcache/hotsets/{uuid}.xml"}, kept


def one_bitmap_on_b(b: Side, name: str) -> None:
    """B's QEMU has the one recording bitmap of B's agent: none came from A."""
    started = lines(b.host, name, "tracker.start")
    assert len(started) == 1, started
    ours = re.search(r"bitmap=(vmcache-[0-9a-f]+)-", started[0][1])
    assert ours, started
    dom = b.conn.lookupByName(name)
    # A rotation adds the next bitmap before it exports and removes the last one: for a moment there are two
    # and no export. A bitmap that came from A stays, so this times out instead of passing.
    left = wait_for(lambda: (x := leftovers(dom)) and not x["exports"] and not x["nodes"] and len(x["bitmaps"]) == 1
                    and x, "a moment with one bitmap and no bitmap read in flight")
    assert len(left["bitmaps"]) == 1 and left["bitmaps"][0].startswith(ours.group(1) + "-"), left


def exact_writes_on_b(b: Side, name: str) -> None:
    """B's agent counts exactly the writes made on B, in dirty-bitmap granules (none of those made on A)."""
    dom = b.conn.lookupByName(name)
    granule = status(b.host, name)["disks"][0]["dirty_granule_bytes"]
    cycles = status(b.host, name)["disks"][0]["cycles"]
    wait_for(lambda: status(b.host, name)["disks"][0]["cycles"] >= cycles + 2, "two more cycles on B")
    assert dirtied(b.host, name) == 0
    guest_write(dom, 20 * MiB, 3 * granule, dev=DEV)               # 3 granules
    guest_write(dom, 30 * MiB + 4096, 4096, dev=DEV)               # 1
    guest_write(dom, 36 * MiB - 4096, 8192, dev=DEV)               # 2: across a granule boundary
    expected = 6 * granule
    wait_for(lambda: dirtied(b.host, name) >= expected, "B's agent to read the writes")
    cycles = status(b.host, name)["disks"][0]["cycles"]
    wait_for(lambda: status(b.host, name)["disks"][0]["cycles"] >= cycles + 2, "two more cycles on B")
    assert dirtied(b.host, name) == expected


def stop_on_b(b: Side, name: str, uuid: str) -> None:
    dom = b.conn.lookupByName(name)
    dom.destroy()
    wait_for(lambda: b.host.unit(unit_of(name))["ActiveState"] == "inactive", "B's agent to stop")
    assert runtime_leftovers(b.host, name, uuid) == []
    dom.undefine()


def test_an_opted_in_domain_moves_warm_exact_and_clean(sides: tuple[Side, Side]) -> None:
    """Opted in by its metadata (vmcache enable): B's agent locks the carried hot set before the guest
    reads on B, counts exactly the writes made on B, and A's agent leaves nothing behind."""
    a, b = sides
    name = PREFIX + "meta"
    dom_a, uuid, carried = start_opted_in(a, name)
    # Written on A just before the switch: never B's to count (A's agent may not even have read it).
    guest_write(dom_a, 50 * MiB, MiB, dev=DEV)
    took = migrate(a, b, name)
    resumed = resume_time(b, name)
    warmed = warm_on_b(b, name, carried, resumed)
    moved_cleanly(a, b, name, uuid)
    record(test="metadata", migrate_s=round(took, 3), set_bytes=carried.bytes,
           locked_after_resume_s=round(warmed - resumed, 3),
           hook_started_after_resume_s=round(_hook_time(b.host, name, "started") - resumed, 3))
    stop_on_b(b, name, uuid)


def test_a_domain_opted_in_only_by_a_host_rule_moves_the_same_way(sides: tuple[Side, Side]) -> None:
    """Defined as Nova defines it (its <nova:instance> metadata, namespace 1.1, nothing of vmcache's): the
    same host rule on both hosts manages it there and here; the set rides in the XML as for the metadata."""
    a, b = sides
    name = PREFIX + "rule"
    dom_a, uuid, carried = start_opted_in(a, name, by_rule=True)
    assert NAMESPACE not in dom_a.XMLDesc(0)  # vmcache's opt-in element: no
    took = migrate(a, b, name)
    resumed = resume_time(b, name)
    warmed = warm_on_b(b, name, carried, resumed, by_rule=True)
    moved_cleanly(a, b, name, uuid)
    record(test="rule", migrate_s=round(took, 3), set_bytes=carried.bytes,
           locked_after_resume_s=round(warmed - resumed, 3))
    stop_on_b(b, name, uuid)


LONG = 35.0  # seconds of incoming migration: more than libvirt's 30 s wait for a domain's job


def slow_migration(a: Side, b: Side, name: str) -> tuple[threading.Thread, list[BaseException]]:
    """``name`` migrating from A to B at 1 MiB/s in a thread (started): the thread, and the error it met."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            migrate(a, b, name, "--bandwidth 1", timeout=600)
        except BaseException as err:  # noqa: BLE001 - reported through ``errors``
            errors.append(err)

    mover = threading.Thread(target=run)
    mover.start()
    return mover, errors


def test_a_long_incoming_migration_is_waited_for_then_the_set_is_locked(sides: tuple[Side, Side]) -> None:
    """A migration whose incoming phase lasts longer than libvirt lets a command wait for the domain's job
    (30 s): B's agent neither times out nor pins while the domain is still coming in (pages read then may
    still change on the source, and QEMU's drop of B's cache at the switch cannot drop locked pages); once
    it is in, B's agent finds the disk, warms from the carried set and tracks every write."""
    a, b = sides
    name = PREFIX + "long"
    _dom_a, uuid, carried = start_opted_in(a, name)
    mover, errors = slow_migration(a, b, name)
    try:
        agent_started = wait_for(lambda: b.host.unit(unit_of(name))["ActiveState"] == "active" and time.time(),
                                 "the hook on B to start the agent as the domain comes in")
        while time.time() < agent_started + LONG:
            assert b.conn.lookupByName(name).state() == [libvirt.VIR_DOMAIN_PAUSED, libvirt.VIR_DOMAIN_PAUSED_MIGRATION]
            time.sleep(1)
        pid = b.host.pids()[int(b.host.unit(unit_of(name))["MainPID"])]
        assert b.host.locked().get(pid, 0) == 0
        early = [m for _t, m in b.host.journal(unit_of(name))
                 if any(e in m for e in ("pin.add", "discovery_failed", "tracker.start", "Timed out"))]
        assert early == [], early
    finally:
        a.host.run("virsh", "migrate-setspeed", name, "--bandwidth", "100000", check=False)
        mover.join()
    assert not errors, errors
    resumed = resume_time(b, name)
    incoming = resumed - agent_started
    warmed = warm_on_b(b, name, carried, resumed)
    assert lines(b.host, name, "agent.migration_wait") and lines(b.host, name, "agent.migration_done")
    moved_cleanly(a, b, name, uuid)
    record(test="long", incoming_s=round(incoming, 1), set_bytes=carried.bytes,
           locked_after_resume_s=round(warmed - resumed, 3))
    stop_on_b(b, name, uuid)


def _hook_time(host: Host, name: str, op: str) -> float:
    """When the hook on ``host`` started the agent for ``name`` on ``op``."""
    out = host.run("journalctl", "-b", "-q", "--no-pager", "-o", "json", "-t", "vmcache-hook")
    for line in out.splitlines():
        entry = json.loads(line)
        if f"domain={name} op={op}" in entry.get("MESSAGE", "") and "hook.start" in entry.get("MESSAGE", ""):
            return int(entry["__REALTIME_TIMESTAMP"]) / 1e6
    raise AssertionError(f"no hook.start of {name} on {op} in {host.name}'s journal")


STAMP_AT = 8          # MiB: where the stamp guest's 64 blocks start (one every 64 KiB: 4 MiB in all)
EARLY_DROPIN = "/etc/systemd/system/vmcache-agent@.service.d/test-pin-before-activation.conf"


def stamp_rounds(name: str) -> int:
    """Rounds of the stamp guest's check-then-write loop finished so far (on A, then on B)."""
    return len(re.findall(r"VMCACHE-STAMP-ROUND \d+ ", console(name)))


def stale_reads(name: str) -> list[str]:
    return [ln.strip() for ln in console(name).splitlines() if "VMCACHE-STAMP-BAD" in ln]


@contextmanager
def pinning_before_activation(host: Host, on: bool) -> Iterator[None]:
    """The test-only switch (vmcache.service.earlypin) for the agents ``host`` starts while inside."""
    if not on:
        yield
        return
    host.run("sh", "-c", f"mkdir -p $(dirname {EARLY_DROPIN}) && printf '[Service]\\n"
                         f"Environment=VMCACHE_TEST_PIN_BEFORE_ACTIVATION=1\\n' > {EARLY_DROPIN} && systemctl daemon-reload")
    try:
        yield
    finally:
        host.run("sh", "-c", f"rm -f {EARLY_DROPIN} && systemctl daemon-reload")


@pytest.mark.parametrize("early", [False, True], ids=["pins-after-activation", "early-pin-switch"])
def test_every_block_read_on_b_holds_the_last_write_made_on_a(sides: tuple[Side, Side], early: bool) -> None:
    """The guest on A keeps rewriting 64 stamped blocks of its hot set, through the migration's whole RAM
    copy, and after the switch reads each one back on B before it writes it again: every read must return
    the stamp last written on A. B's agent locks the carried set only once the domain runs on B (after
    QEMU dropped B's cache at activation), so B reads the new data. The same test with the test-only switch
    that locks the set as the domain comes in (before activation) must see stale blocks: the locked pages
    survive QEMU's drop and keep the bytes B read before A's last writes - proof the check can fail."""
    a, b = sides
    name = PREFIX + ("early" if early else "stamp")
    define_guest(a, name, workload="stamp", stamp_at=STAMP_AT)
    a.host.run("vmcache", "enable", name, "--budget", "16M", "--config")
    with pinning_before_activation(b.host, early):
        a.host.run("virsh", "start", name)
        dom = a.conn.lookupByName(name)
        uuid = dom.UUIDString()
        agent_running(a.host, name)
        wait_for(lambda: stamp_rounds(name) >= 1, "the guest's first round of stamps", timeout=180, step=0.5)
        read_until_pinned(dom, STAMP_AT * MiB, 4 * MiB,
                          lambda: (s := status(a.host, name)) and s["disks"][0]["pinned_bytes"] or 0,
                          "A's agent to pin the stamped range", dev=DEV)
        carried = saved_set(a, name, 4 * MiB)
        assert resident(1, name, 0, 64 * MiB) == 0
        # A RAM copy of several seconds at 16 MiB/s: rounds of stamps written on A while B waits for the domain.
        before = stamp_rounds(name)
        took = migrate(a, b, name, "--bandwidth 16")
        resumed = resume_time(b, name)
        during = stamp_rounds(name) - before
        assert during >= 1, f"no round of stamps finished during the migration ({took:.1f} s)"
        if early:
            pinned = wait_for(lambda: lines(b.host, name, "test.pinned_before_activation"), "the early pins on B")
            assert pinned[0][0] < resumed, (pinned, resumed)
        else:
            warmed = wait_for(lambda: lines(b.host, name, "warm.done"), "B's agent to restore the set", timeout=60)
            first = min(t for t, _m in lines(b.host, name, "pin.add"))
            assert first >= resumed - SLACK, (first, resumed)
        switch = stamp_rounds(name)
        wait_for(lambda: stamp_rounds(name) >= switch + 2, "two rounds of stamps on B", timeout=120, step=0.5)
        bad = stale_reads(name)
        if early:
            assert bad, "no stale read after pins made before activation: the check cannot fail"
        else:
            assert bad == [], bad[:10]
            assert resident(1, name, STAMP_AT * MiB, 4 * MiB) >= carried.bytes // 2
            record(test="stamp", migrate_s=round(took, 3), rounds_during=during, set_bytes=carried.bytes,
                   locked_after_resume_s=round(warmed[0][0] - resumed, 3))
    if early:
        record(test="stamp-early-pin", migrate_s=round(took, 3), rounds_during=during, stale_reads=len(bad))
    stop_on_b(b, name, uuid)


def vmcache_mappings(host: Host, name: str) -> list[str]:
    """Lines of /proc/PID/maps of the host's vmcache processes that map the domain's image."""
    _, there = shared_from_env()
    image = f"{there}/{name}.raw"
    found = []
    for pid in host.pids().values():
        if "vmcache" not in _cmdline(pid):
            continue
        try:
            found += [f"{pid}: {ln}" for ln in Path(f"/proc/{pid}/maps").read_text().splitlines() if image in ln]
        except OSError:
            continue   # gone meanwhile
    return found


def test_a_cancelled_migration_leaves_nothing_of_the_image_mapped_on_b(sides: tuple[Side, Side]) -> None:
    """Cancelled while the domain comes in on B: B's agent, which waited without mapping anything of the
    image, ends with the incoming domain and leaves nothing behind; the guest runs on on A, its agent too."""
    a, b = sides
    name = PREFIX + "cancel"
    _dom_a, uuid, _carried = start_opted_in(a, name)
    mover, errors = slow_migration(a, b, name)   # cancelled: it fails, as expected
    try:
        wait_for(lambda: lines(b.host, name, "agent.migration_wait"), "B's agent to wait for the incoming domain")
        assert vmcache_mappings(b.host, name) == []
    finally:
        a.host.run("virsh", "domjobabort", name, check=False)
        mover.join()
    assert errors and "cancel" in str(getattr(errors[0], "stderr", errors[0])).lower(), errors
    wait_for(lambda: b.host.unit(unit_of(name))["ActiveState"] == "inactive", "B's agent to end")
    assert b.host.unit(unit_of(name))["Result"] == "success"
    assert lines(b.host, name, "pin.add") == [] and vmcache_mappings(b.host, name) == []
    assert runtime_leftovers(b.host, name, uuid) == []
    dom = a.conn.lookupByName(name)
    assert dom.state()[0] == libvirt.VIR_DOMAIN_RUNNING
    assert (s := status(a.host, name)) and s["state"] == "running" and s["disks"][0]["pinned_bytes"] > 0, s
    dom.destroy()
    wait_for(lambda: a.host.unit(unit_of(name))["ActiveState"] == "inactive", "A's agent to stop")
    assert runtime_leftovers(a.host, name, uuid) == []
    dom.undefine()
