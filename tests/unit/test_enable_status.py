"""vmcache enable / disable / status against libvirt's in-process test driver (test:///default)."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any
from pathlib import Path

import libvirt
import pytest

from vmcache.cli import main
from vmcache.settings.metadata import NAMESPACE, DiskOverride, DomainSettings, parse_settings
from vmcache.observe.status import AgentStatus, DiskStatus, status_path, write_status

from tests.standin_agent import kill_agents

URI = "test:///default"  # one in-process hypervisor, shared while a connection is open; "test" runs
_held: list[Any] = []  # the fixture's connection: keeps the test driver's state alive between commands
STANDIN = str(Path(__file__).resolve().parents[1] / "standin_agent.py")
GiB = 1 << 30


def metadata(live: bool):
    dom = _held[0].lookupByName("test")
    flags = libvirt.VIR_DOMAIN_AFFECT_LIVE if live else libvirt.VIR_DOMAIN_AFFECT_CONFIG
    try:
        return parse_settings(dom.metadata(libvirt.VIR_DOMAIN_METADATA_ELEMENT, NAMESPACE, flags))
    except libvirt.libvirtError as err:
        assert err.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN_METADATA
        return None


@pytest.fixture
def host(tmp_path):
    markers = tmp_path / "markers"
    markers.mkdir()
    config = tmp_path / "vmcache.yaml"
    config.write_text(f"runtime_dir: {tmp_path}/run\nlog_dir: {tmp_path}/log\nbudget: 3G\nhotset_dir: {tmp_path}/hotsets\n"
                      f"agent_command: [{sys.executable}, {STANDIN}, {markers}]\n")
    libvirt.registerErrorHandler(lambda _c, _e: None, None)
    _held.append(libvirt.open(URI))
    try:
        yield ["--host-config", str(config), "--uri", URI], tmp_path, markers
    finally:
        _held.pop().close()  # the test driver forgets everything
        kill_agents(f"{tmp_path}/run/agents")


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    raise AssertionError("timed out")


def test_enable_live_sets_metadata_and_starts_the_agent(host, capsys):
    opts, tmp_path, markers = host
    assert main(["enable", "test", "--budget", "2G", "--live", "--exclude", "vdb", "--disk-budget", "vdc=512M",
                 *opts]) == 0
    out = capsys.readouterr().out
    assert "test: vmcache enabled, budget 2GiB" in out
    assert "test: agent started (pid " in out
    assert metadata(live=True) == DomainSettings(
        enabled=True, budget=2 * GiB,
        disks=(DiskOverride("vdb", exclude=True), DiskOverride("vdc", budget=512 << 20)))
    assert metadata(live=False) is None  # --live only
    wait_for(lambda: (markers / "test.started").exists())
    # enabling again: settings kept and updated, the agent is not started twice
    assert main(["enable", "test", "--budget", "1G", "--live", *opts]) == 0
    assert "agent already-running" in capsys.readouterr().out
    settings = metadata(live=True)
    assert settings.budget == GiB and settings.disk("vdb").exclude and settings.disk("vdc").budget == 512 << 20
    assert len((markers / "test.started").read_text().splitlines()) == 1
    # status shows it (the stand-in wrote its status file)
    wait_for(lambda: Path(status_path(f"{tmp_path}/run/agents", "test")).exists())
    assert main(["status", "--json", "--host-config", opts[1], "--uri", URI]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["domain"], r["running"], r["state"]) for r in rows] == [("test", True, "running")]
    # disable: metadata says no, the agent is stopped
    assert main(["disable", "test", "--live", *opts]) == 0
    out = capsys.readouterr().out
    assert "test: vmcache disabled" in out and "agent stopping" in out
    assert metadata(live=True).enabled is False and metadata(live=True).budget == GiB
    wait_for(lambda: (markers / "test.stopped").exists())


def test_enable_undoes_an_exclusion_and_an_own_disk_budget_and_says_what_each_disk_has(host, capsys):
    opts, _, _ = host
    assert main(["enable", "test", "--config", "--exclude", "vdb", "--disk-budget", "vdc=512M", *opts]) == 0
    assert "test: disks: vdb excluded; vdc own budget 512MiB" in capsys.readouterr().out
    # --include takes vdb back in; --disk-budget DEV=default lets vdc share the domain's rest again
    assert main(["enable", "test", "--config", "--include", "vdb", "--disk-budget", "vdc=default", *opts]) == 0
    out = capsys.readouterr().out
    assert metadata(live=False) == DomainSettings(enabled=True, budget=None)
    assert "disks:" not in out
    assert main(["enable", "test", "--config", "--include", "vdb", "--exclude", "vdb", *opts]) == 2
    assert capsys.readouterr().err.strip() == "vmcache enable: --include: 'vdb': also given to --exclude"


def test_enable_config_only_does_not_start_an_agent(host, capsys):
    opts, _, markers = host
    assert main(["enable", "test", "--config", *opts]) == 0
    assert "budget host default 3GiB" in capsys.readouterr().out
    assert metadata(live=False) == DomainSettings(enabled=True, budget=None)
    assert metadata(live=True) is None
    time.sleep(0.2)
    assert list(markers.iterdir()) == []
    assert main(["disable", "test", "--config", "--remove", *opts]) == 0
    assert metadata(live=False) is None


def test_errors_are_one_line(host, capsys):
    opts, _, _ = host
    assert main(["enable", "no-such-domain", *opts]) == 1
    assert capsys.readouterr().err.strip() == "vmcache enable: no domain named 'no-such-domain'"
    assert main(["enable", "test", "--disk-budget", "vdc", *opts]) == 2
    assert capsys.readouterr().err.strip() == "vmcache enable: --disk-budget: 'vdc': use DEV=SIZE, e.g. vdc=512M"
    assert main(["enable", "test", "--exclude", "v d", *opts]) == 2
    assert "metadata disk[0] dev: 'v d': must be a target dev" in capsys.readouterr().err
    assert main(["enable", "test", "--uri", "test:///nonexistent/file.xml", "--host-config", opts[1]]) == 1
    assert capsys.readouterr().err.startswith("vmcache enable: cannot connect to test:///nonexistent/file.xml")
    assert metadata(live=True) is None  # nothing was written


def test_status_human_and_dead_agents(host, capsys, tmp_path):
    opts, _, _ = host
    agents = f"{tmp_path}/run/agents"
    import subprocess

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    write_status(status_path(agents, "gone"), AgentStatus(
        domain="gone", pid=dead.pid, state="running", budget_bytes=GiB, granted_bytes=GiB, last_error="boom",
        disks=[DiskStatus("vda", "/img/a", "writethrough", True, budget_bytes=GiB, pinned_bytes=1 << 20,
                          resident_bytes=2 << 20, dirtied_bytes_per_second=4096, dirty_granule_bytes=65536,
                          last_cycle_seconds=0.25,
                          last_cycle_at=time.time()),
               DiskStatus("vdb", "/img/b", "none", False, reason="cache=none bypasses the page cache")]))
    assert main(["status", "--host-config", opts[1], "--uri", URI]) == 0
    out = capsys.readouterr().out
    # its pins went with its process (the kernel unlocks a process's memory when it ends): 0, and what it held
    assert out.startswith(f"gone: not running pid {dead.pid}, budget 1GiB, demand -, granted 1GiB, "
                          "pinned 0B (1MiB at its last status), resident 2MiB")
    assert "  last error: boom" in out
    assert ("vda    cache=writethrough budget 1GiB pinned 0B (1MiB at its last status) resident 2MiB dirtied 4KiB/s "
            "(64KiB granules) last cycle 0.250s") in out
    assert main(["status", "gone", "--json", "--host-config", opts[1], "--uri", URI]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["pinned_bytes"], row["last_pinned_bytes"]) == (0, 1 << 20)
    assert (row["disks"][0]["pinned_bytes"], row["disks"][0]["last_pinned_bytes"]) == (0, 1 << 20)
    assert "vdb    cache=none         skipped: cache=none bypasses the page cache" in out
    assert main(["status", "other", "--host-config", opts[1], "--uri", URI]) == 1
    assert "no vmcache agent for domain 'other'" in capsys.readouterr().err


def test_status_shows_warm_start_progress_and_the_last_save(host, capsys, tmp_path):
    opts, _, _ = host
    write_status(status_path(f"{tmp_path}/run/agents", "web"), AgentStatus(
        domain="web", pid=os.getpid(), state="running", hotset_saved_at=time.time() - 30, hotset_source="host",
        disks=[DiskStatus("vda", "/img/a", "writethrough", True, budget_bytes=GiB, pinned_bytes=96 << 20,
                          warm_restored_bytes=96 << 20, warm_total_bytes=256 << 20),
               DiskStatus("vdb", "/img/b", "writethrough", True, budget_bytes=GiB)]))
    assert main(["status", "web", "--host-config", opts[1], "--uri", URI]) == 0
    out = capsys.readouterr().out
    assert ", hot set saved 30s ago" in out.splitlines()[0] or ", hot set saved 31s ago" in out.splitlines()[0]
    vda, vdb = (next(ln for ln in out.splitlines() if ln.startswith(f"  {dev} ")) for dev in ("vda", "vdb"))
    assert " warm 96MiB/256MiB from the host's copy" in vda
    assert " warm" not in vdb  # a disk that started cold


@pytest.mark.parametrize("signal, reason, line", [
    ("probe", None, "  guest reads: probe (counted at filemap_read)"),
    ("tracepoint", None, "  guest reads: tracepoint (counted at mm_filemap_get_pages)"),
    ("inferred", "probe: program vmcache_fread1: Operation not permitted",
     "  guest reads: inferred (probe: program vmcache_fread1: Operation not permitted)")])
def test_status_says_which_counter_runs_or_why_reads_are_inferred(host, capsys, tmp_path, signal, reason, line):
    opts, _, _ = host
    write_status(status_path(f"{tmp_path}/run/agents", "web"), AgentStatus(
        domain="web", pid=os.getpid(), state="running", read_signal=signal, read_signal_reason=reason))
    assert main(["status", "web", "--host-config", opts[1], "--uri", URI]) == 0
    assert line in capsys.readouterr().out.splitlines()


def test_status_host_line_says_how_the_cap_is_divided(tmp_path):
    import os

    from vmcache.commands.status import host_line
    from vmcache.host.ledger import Ledger
    from vmcache.model.share import Demand

    MiB = 1 << 20
    path = tmp_path / "ledger.json"
    assert host_line(Ledger(str(path), None).host_share()) is None  # nobody published yet
    a = Ledger(str(path), 100 * MiB)
    a.divide("a", Demand(budget=100 * MiB, minimum=80 * MiB))
    a.divide("b", Demand(budget=100 * MiB, minimum=40 * MiB))
    # an older agent's entry: bytes in ledger.json, no demand
    data = json.loads(path.read_text())
    data["domains"]["old"] = {"pid": os.getpid(), "pid_start_time": None, "bytes": 10 * MiB}
    path.write_text(json.dumps(data))
    line = host_line(Ledger(str(path), None).host_share())
    assert line.startswith("host: pinned cap 100MiB, held ")
    assert "1 older agents hold 10MiB first come" in line
    assert "\n  error: guaranteed minimums (min=) add up to 120MiB, more than the 90MiB" in line


def test_agents_started_by_a_command_get_the_config_by_absolute_path(tmp_path, monkeypatch):
    import argparse

    from vmcache.commands import _host

    seen = {}

    class Launcher:
        def start(self, domain):
            return f"started {domain}"

    def make_launcher(config, *, config_path):
        seen["path"] = config_path
        return Launcher()

    monkeypatch.setattr(_host, "make_launcher", make_launcher)
    monkeypatch.chdir(tmp_path)
    _host.ensure_agent(argparse.Namespace(host_config="vmcache.yaml"), None, "d", running=True)
    # the agent runs detached from /: a relative path would name another file
    assert seen["path"] == str(tmp_path / "vmcache.yaml")


def test_hotset_shows_the_newest_set_and_where_it_is_kept_and_clear_removes_every_copy(host, capsys):
    from vmcache.host.hotstore import HotStore
    from vmcache.host.virtdomain import Affect, VirtDomain
    from vmcache.model.region import Region
    from vmcache.settings.hotset import DiskHotSet, HotSet

    opts, tmp_path, _ = host
    MiB = 1 << 20
    dom = VirtDomain(_held[0], "test")
    record = DiskHotSet("vda", "/img/a.raw", 64 * MiB, None, MiB, (Region(0, 2 * MiB, 2.0),))
    dom.set_hotset(HotSet(1000, (record,)), Affect.LIVE | Affect.CONFIG)
    store = HotStore(f"{tmp_path}/hotsets")
    newer = HotSet(2000, (DiskHotSet("vda", "/img/a.raw", 64 * MiB, None, MiB, (Region(0, 4 * MiB, 2.0),)),))
    store.save(dom.uuid(), newer)
    assert main(["hotset", "test", *opts]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"test: hot set from the host's copy ({store.path(dom.uuid())}), saved ")
    assert "  vda: 1 regions, 4MiB of /img/a.raw" in out
    # every save's time as a date, the copies' as the chosen one's
    old = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(1000))
    assert f"also in: the live definition saved {old} (older); the persistent definition saved {old} (older)" in out
    assert main(["hotset", "test", "--json", *opts]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["source"] == "host" and shown["saved"] == 2000 and shown["places"]["live"]["saved"] == 1000
    assert main(["hotset", "test", "--live", *opts]) == 0
    assert capsys.readouterr().out.startswith("test: hot set from the live definition, saved ")
    assert main(["hotset", "test", "--clear", *opts]) == 0
    assert "removed from the live definition, the persistent definition, the host's copy" in capsys.readouterr().out
    assert store.load(dom.uuid()) is None and dom.hotset(Affect.LIVE) is None and dom.hotset(Affect.CONFIG) is None
    assert main(["hotset", "test", *opts]) == 0
    assert capsys.readouterr().out.strip() == "test: no saved hot set"


def test_disable_remove_says_when_a_host_rule_still_manages_the_domain(host, capsys, tmp_path):
    opts, _, markers = host
    config = Path(opts[1])
    config.write_text(config.read_text() + "domains:\n  - match: {name: te*}\n    budget: 1G\n")
    assert main(["enable", "test", "--config", *opts]) == 0
    assert main(["disable", "test", "--remove", "--live", *opts]) == 0
    out = capsys.readouterr().out
    assert "test: still managed by rule 1: name=te* (host config)" in out and "agent stopping" not in out


def test_disable_of_a_domain_a_rule_manages_writes_enabled_no_which_wins(host, capsys):
    opts, _, markers = host
    config = Path(opts[1])
    config.write_text(config.read_text() + "domains:\n  - match: {name: te*}\n")
    assert main(["disable", "test", "--live", *opts]) == 0
    out = capsys.readouterr().out
    assert out.startswith("test: vmcache disabled (over rule 1: name=te* of the host config;") and "agent" in out
    assert metadata(live=True) == DomainSettings(enabled=False)
    config.write_text(config.read_text().replace("domains:", "domains: []\nx_domains:").split("x_domains")[0])
    assert main(["disable", "test", "--config", *opts]) == 0  # no rule any more, no element in the persistent XML
    assert capsys.readouterr().out == "test: no vmcache metadata, nothing to disable\n"
