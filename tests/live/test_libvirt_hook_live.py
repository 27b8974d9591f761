"""The installed hook with the real libvirtd: opted-in domains get an agent, others none.

The hook is host-wide: a live test that installs it holds hooklib.HOOK_LOCK
(flock) while it is installed, so two such tests never replace each other's hook.

Installs the hook with scripts/install.sh --hook-only (this venv's Python,
a temporary host config whose ``agent_command`` is tests/standin_agent.py),
which makes libvirtd reload so it sees the hook. A foreign
/etc/libvirt/hooks/qemu is never touched (the hook then goes to qemu.d/),
and a vmcache hook already installed is put back as it was afterwards.
Domains are transient, TCG, started paused with a small writethrough raw
disk: no guest OS needed. Everything is cleaned up even on failure.

The agent command is configured, not hard-wired: the same test checks the
hook -> launcher -> agent path once the real ``vmcache agent`` exists.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

libvirt = pytest.importorskip("libvirt")

from vmcache.cli import main  # noqa: E402
from vmcache.host.files import lock_holder  # noqa: E402
from vmcache.settings.metadata import NAMESPACE  # noqa: E402
from vmcache.host.files import file_stem  # noqa: E402

from tests.live import livelib  # noqa: E402
from tests.live.livelib import REPO, LiveEnv, cache_metadata, connect, domain_xml, start_paused  # noqa: E402

pytestmark = pytest.mark.live

PREFIX = f"vmcache-test-hook-{os.getpid()}-"
TIMEOUT = 15.0
wait_for = functools.partial(livelib.wait_for, timeout=TIMEOUT, step=0.05)


@dataclass
class Env(LiveEnv):
    """The host config's files, plus the markers the stand-in agent leaves."""

    markers: Path = Path()

    def started(self, name: str) -> Path:
        return self.markers / (file_stem(name) + ".started")

    def stopped(self, name: str) -> Path:
        return self.markers / (file_stem(name) + ".stopped")


@pytest.fixture(scope="module")
def env(live_tmp: Path, hooked) -> Iterator[Env]:
    markers = live_tmp / "markers"
    markers.mkdir()
    config = live_tmp / "vmcache.yaml"
    config.write_text(f"runtime_dir: {live_tmp}/run\nlog_dir: {live_tmp}/log\n"
                      f"agent_command: [{sys.executable}, {REPO}/tests/standin_agent.py, {markers}]\n")
    e = Env(connect(), live_tmp, config, markers=markers)
    print(hooked(config, PREFIX, e.agents))
    e.conn = connect()  # the hook lock may have been waited for while another test restarted libvirtd
    try:
        yield e
    finally:
        try:
            e.conn.close()
        except libvirt.libvirtError:
            pass


def start(env: Env, name: str, *, opted_in: bool):
    disk = env.disk(name, 16 << 20)
    return start_paused(env.conn, domain_xml(name, disk, metadata=cache_metadata("8M" if opted_in else None)))


def agent_pid(env: Env, name: str) -> int:
    record = json.loads(wait_for(lambda: env.started(name).exists() and env.started(name).read_text(),
                                 f"the agent of {name}"))
    return record["pid"]


def test_opted_in_domain_gets_an_agent_that_stops_with_it(env: Env):
    name = PREFIX + "on"
    dom = start(env, name, opted_in=True)
    pid = agent_pid(env, name)
    record = json.loads(env.started(name).read_text())
    assert record["argv"][-6:] == ["--host-config", str(env.config), "--domain-id", str(dom.ID()), "--domain", name]
    assert lock_holder(str(env.agents / (file_stem(name) + ".pid"))) == pid
    assert f"hook.start domain={name} op=started" in env.hook_log()
    # the agent is detached from libvirtd: not its child, stdin is /dev/null
    assert record["ppid"] != livelib.libvirtd_pid()
    assert os.readlink(f"/proc/{pid}/fd/0") == "/dev/null"
    # virsh destroy: the stopped/release hook stops it
    dom.destroy()
    stopped = json.loads(wait_for(lambda: env.stopped(name).exists() and env.stopped(name).read_text(),
                                  "the agent to be stopped"))
    assert stopped == {"pid": pid, "signal": "TERM"}
    assert f"hook.stop domain={name} op=stopped" in env.hook_log()


def test_domain_without_metadata_gets_none_until_enabled_live(env: Env, capsys):
    name = PREFIX + "off"
    dom = start(env, name, opted_in=False)
    # createXML returns after the started hook ran: its decision is logged by then
    wait_for(lambda: f'hook.ignore domain={name} op=started reason="no vmcache metadata"' in env.hook_log(),
             "the hook's log line")
    time.sleep(0.5)
    assert not env.started(name).exists()
    # vmcache enable --live on the running domain starts an agent at once
    assert main(["enable", name, "--budget", "4M", "--live", "--host-config", str(env.config)]) == 0
    assert "agent started" in capsys.readouterr().out
    pid = agent_pid(env, name)
    assert main(["status", name, "--json", "--host-config", str(env.config)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["domain"], r["running"]) for r in rows] == [(name, True)]
    # and the hook stops it when the domain goes
    dom.destroy()
    wait_for(lambda: env.stopped(name).exists(), "the agent to be stopped")
    assert json.loads(env.stopped(name).read_text())["pid"] == pid


def test_save_and_restore_keep_the_xml_and_the_agent(env: Env):
    """restore is an XML filter: the hook must hand the XML back unchanged, then started starts the agent."""
    name = PREFIX + "restore"
    dom = start(env, name, opted_in=True)
    first = agent_pid(env, name)
    image = env.tmp / "saved.img"
    dom.save(str(image))  # stops the domain: its agent is stopped
    wait_for(lambda: env.stopped(name).exists(), "the agent to be stopped on save")
    env.started(name).unlink()
    env.conn.restore(str(image))
    restored = env.conn.lookupByName(name)
    assert NAMESPACE in restored.XMLDesc()
    second = agent_pid(env, name)
    assert second != first
    assert f"domain={name} op=restore" not in env.hook_log()  # filters are silent
    restored.destroy()
