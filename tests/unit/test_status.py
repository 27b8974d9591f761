"""Status files: schema round trip, atomic write, dead agents shown as not running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vmcache.errors import HostError
from vmcache.model.stats import CycleStats
from vmcache.observe.status import (
    AgentStatus,
    DiskStatus,
    read_status,
    read_statuses,
    status_path,
    write_status,
)
from vmcache.model.extents import BitmapRead
from vmcache.model.pinvalue import PinWorth


def sample(domain="web-1", pid=None) -> AgentStatus:
    return AgentStatus(
        domain=domain, pid=os.getpid() if pid is None else pid, uuid="u-1", state="running",
        started_at=100.0, interval=10.0, budget_bytes=2 << 30, granted_bytes=1 << 30,
        metrics_url="http://127.0.0.1:9470/metrics",
        disks=[
            DiskStatus("vda", "/img/a.raw", "writethrough", True, budget_bytes=1 << 30, pinned_bytes=4096,
                       resident_bytes=8192, dirtied_bytes_per_second=512.0, last_cycle_seconds=0.01,
                       last_cycle_at=110.0),
            DiskStatus("vdb", "/img/b.raw", "none", False, reason="cache=none bypasses the page cache"),
        ],
    )


def test_write_then_read_round_trip(tmp_path):
    path = status_path(str(tmp_path / "agents"), "web-1")
    original = sample()
    write_status(path, original, now=123.0)
    loaded = read_status(path)
    assert loaded == original
    assert loaded.updated_at == 123.0
    assert loaded.pid_start_time is not None  # filled from /proc
    assert loaded.pinned_bytes == 4096 and loaded.resident_bytes == 8192
    data = json.loads(Path(path).read_text())
    assert data["version"] == 1 and data["disks"][1]["reason"] == "cache=none bypasses the page cache"
    assert [p for p in os.listdir(tmp_path / "agents") if p.startswith(".")] == []  # no temp file left


def test_unknown_keys_are_ignored_wrong_version_refused(tmp_path):
    path = tmp_path / "x.json"
    data = sample().to_json()
    data["future_field"] = 1
    data["disks"][0]["future"] = 2
    path.write_text(json.dumps(data))
    assert read_status(str(path)).domain == "web-1"
    data["version"] = 2
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="schema version 2"):
        read_status(str(path))


def test_disk_update_from_cycle_stats():
    disk = DiskStatus("vda", "/img", "writethrough", True)
    stats = CycleStats(
        now=5.0, duration_seconds=0.02, size_bytes=1 << 30, budget_bytes=1 << 29, pinned_bytes=1 << 20,
        pinned_regions=3, resident_bytes=1 << 21, guest_written_bytes=10 << 20, guest_read_miss_bytes=0,
        recently_evicted_pages=None, bitmap_read=BitmapRead.OK, mem_available_bytes=1 << 33, backing_off=False,
        error="BitmapReadError: x")
    disk.update(stats, elapsed=10.0, wall_time=1000.0)
    assert (disk.budget_bytes, disk.pinned_bytes, disk.resident_bytes) == (1 << 29, 1 << 20, 1 << 21)
    assert disk.dirtied_bytes_per_second == 1 << 20
    assert (disk.last_cycle_seconds, disk.last_cycle_at, disk.error) == (0.02, 1000.0, "BitmapReadError: x")
    assert disk.cycles == 1
    disk.update(stats, elapsed=10.0, wall_time=1010.0)
    assert disk.cycles == 2


def test_read_statuses_marks_dead_agents_and_bad_files(tmp_path):
    agents = str(tmp_path / "agents")
    write_status(status_path(agents, "live"), sample("live"))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    write_status(status_path(agents, "dead"), sample("dead", pid=dead.pid))
    # our pid, but recorded with another start time: pid reused -> not running
    reused = sample("reused")
    reused.pid_start_time = 1
    write_status(status_path(agents, "reused"), reused)
    (tmp_path / "agents" / "broken.json").write_text("{")
    (tmp_path / "agents" / "live.pid").write_text("1")  # not a status file
    entries = read_statuses(agents)
    by_name = {(e.status.domain if e.status else os.path.basename(e.path)): e for e in entries}
    assert set(by_name) == {"live", "dead", "reused", "broken.json"}
    assert by_name["live"].running is True
    assert by_name["dead"].running is False
    assert by_name["reused"].running is False
    assert by_name["broken.json"].status is None and "not JSON" in by_name["broken.json"].problem


def test_absent_dir_is_empty(tmp_path):
    assert read_statuses(str(tmp_path / "none")) == []


def test_write_failure_is_a_host_error(tmp_path):
    blocker = tmp_path / "f"
    blocker.write_text("")
    with pytest.raises(HostError, match="cannot write status"):
        write_status(str(blocker / "x.json"), sample())


def test_an_older_agents_write_rate_is_read_as_dirtied():
    data = {"version": 1, "domain": "d", "pid": 1, "disks": [
        {"target": "vda", "source": "/i", "cache": "writethrough", "eligible": True, "write_bytes_per_second": 64.0}]}
    assert AgentStatus.from_json(data).disks[0].dirtied_bytes_per_second == 64.0


def test_layers_are_named_in_the_human_table_and_round_trip():
    from vmcache.commands.status import render

    status = AgentStatus(domain="d", pid=1, disks=[
        DiskStatus(target="vdb", source="/top.qcow2", cache="writethrough", eligible=True, pinned_bytes=1 << 20),
        DiskStatus(target="vdb", source="/base.raw", cache="writethrough", eligible=True, pinned_bytes=4 << 20,
                   layer_of="vdb"),
        DiskStatus(target="vdc", source="/gold.raw", cache="writethrough", eligible=False,
                   reason="managed by domain web-2", layer_of="vdc")])
    assert AgentStatus.from_json(status.to_json()).disks[1].layer_of == "vdb"
    text = render([{**status.to_json(), "running": True}], now=0.0)
    lines = text.splitlines()
    assert lines[-3].endswith("(/top.qcow2)") and lines[-2].endswith("(layer: /base.raw)")
    assert lines[-1].endswith("skipped: managed by domain web-2  (layer: /gold.raw)")


def test_pins_that_hold_less_than_they_count_show_what_they_hold():
    """``fill: cached``: the table says what the pins hold where it is less than what they count."""
    from vmcache.commands.status import _row, render
    from vmcache.observe.status import AgentEntry

    status = AgentStatus(domain="d", pid=1, disks=[
        DiskStatus(target="vda", source="/a.raw", cache="writethrough", eligible=True, pinned_bytes=8 << 20,
                   locked_bytes=3 << 20),
        DiskStatus(target="vdb", source="/b.raw", cache="writethrough", eligible=True, pinned_bytes=2 << 20,
                   locked_bytes=2 << 20),
        DiskStatus(target="vdc", source="/c.raw", cache="writethrough", eligible=True, pinned_bytes=1 << 20)])
    assert AgentStatus.from_json(status.to_json()).locked_bytes == 6 << 20
    row = _row(AgentEntry("/run/vmcache/agents/d.json", status, running=True))
    assert row["locked_bytes"] == 6 << 20
    lines = render([row], now=0.0).splitlines()
    assert "pinned 11MiB (6MiB locked)," in lines[0]
    assert " pinned 8MiB (3MiB locked) " in lines[-3]
    assert " pinned 2MiB resident" in lines[-2] and " pinned 1MiB resident" in lines[-1]  # all held: said once
    gone = _row(AgentEntry("/run/vmcache/agents/d.json", status, running=False))
    assert "locked" not in render([gone], now=0.0)  # the kernel unlocked it all when the agent ended
    assert AgentStatus(domain="d", pid=1, disks=status.disks[2:]).locked_bytes is None


def test_a_disks_line_says_what_its_pins_saved_and_how_long_the_kernel_keeps_a_page():
    from vmcache.commands.status import render

    disk = DiskStatus(target="vda", source="/a.raw", cache="writethrough", eligible=True, pinned_bytes=8 << 20)
    disk.update_reads(40 << 20, 30 << 20, elapsed=10.0, worth=PinWorth(6 << 20, 1 << 20, 64.0))
    disk.update_reads(4 << 20, 4 << 20, elapsed=10.0, worth=PinWorth(1 << 20, None, 64.0))
    status = AgentStatus(domain="d", pid=1, disks=[disk])
    back = AgentStatus.from_json(json.loads(json.dumps(status.to_json())))
    assert back.disks[0].pin_saved_bytes == 7 << 20 and back.disks[0].kernel_retention_seconds == 64.0
    line = render([{**status.to_json(), "running": True}], now=0.0).splitlines()[-1]
    assert "pins saved up to ~7MiB, cost others ~1MiB of device reads (the kernel keeps a page read again ~64s)" in line
    disk.update_reads(1 << 20, 1 << 20, elapsed=10.0, worth=PinWorth(0, 0, float("inf")))
    assert json.loads(json.dumps(status.to_json()))["disks"][0]["kernel_retention_seconds"] == -1
    assert "the kernel keeps what is read again" in render([{**status.to_json(), "running": True}], now=0.0)
    unjudged = DiskStatus(target="vda", source="/a.raw", cache="writethrough", eligible=True)
    unjudged.update_reads(1 << 20, 1 << 20, elapsed=10.0)   # inferred decisions: nothing judged, nothing said
    assert "pins saved" not in render([{**AgentStatus(domain="d", pid=1, disks=[unjudged]).to_json(),
                                        "running": True}], now=0.0)
