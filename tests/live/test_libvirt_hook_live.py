"""The installed hook with the real libvirtd: opted-in domains get an agent, others none.

The hook is host-wide: a live test that installs it holds HOOK_LOCK (flock)
while it is installed, so two such tests never replace each other's hook.

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

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
import uuid as uuidlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

libvirt = pytest.importorskip("libvirt")

from vmcache.cli import main  # noqa: E402
from vmcache.launcher import pidfile_holder  # noqa: E402
from vmcache.metadata import NAMESPACE  # noqa: E402
from vmcache.status import file_stem  # noqa: E402

from tests.standin_agent import kill_agents  # noqa: E402

pytestmark = pytest.mark.live

REPO = Path(__file__).resolve().parents[2]
URI = "qemu:///system"
HOOKS_DIR = Path("/etc/libvirt/hooks")
PREFIX = f"vmcache-test-hook-{os.getpid()}-"
TIMEOUT = 15.0
# The hook is host-wide: live tests that install it take this lock for as long as it is theirs.
HOOK_LOCK = "/run/lock/vmcache-live-hook.lock"


@dataclass
class Env:
    conn: object
    tmp: Path
    config: Path
    markers: Path
    agents: Path
    log: Path

    def started(self, name: str) -> Path:
        return self.markers / (file_stem(name) + ".started")

    def stopped(self, name: str) -> Path:
        return self.markers / (file_stem(name) + ".stopped")


def wait_for(predicate, what: str, timeout: float = TIMEOUT):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _libvirtd_up() -> bool:
    try:
        libvirt.open(URI).close()
        return True
    except libvirt.libvirtError:
        return False


def _our_hook(path: Path) -> bool:
    return path.is_file() and "vmcache-hook" in path.read_text(errors="replace")


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> Iterator[Env]:
    if os.geteuid() != 0:
        pytest.skip("needs root (libvirt hooks live in /etc/libvirt/hooks)")
    libvirt.registerErrorHandler(lambda _c, _e: None, None)
    if not _libvirtd_up():
        pytest.skip("libvirtd does not answer on qemu:///system (scripts/libvirtd.sh starts it)")
    tmp = tmp_path_factory.mktemp("hook-live")
    tmp.chmod(0o755)
    markers = tmp / "markers"
    markers.mkdir()
    config = tmp / "vmcache.yaml"
    config.write_text(f"runtime_dir: {tmp}/run\nlog_dir: {tmp}/log\n"
                      f"agent_command: [{sys.executable}, {REPO}/tests/standin_agent.py, {markers}]\n")
    os.makedirs(os.path.dirname(HOOK_LOCK), exist_ok=True)
    lock = os.open(HOOK_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    fcntl.flock(lock, fcntl.LOCK_EX)  # waits for another live test's hook to be gone
    # put back afterwards whatever vmcache hook was there (a real install); a foreign one is never touched
    backups = {p: p.read_bytes() for p in (HOOKS_DIR / "qemu", HOOKS_DIR / "qemu.d" / "vmcache") if _our_hook(p)}
    conn = libvirt.open(URI)
    e = Env(conn, tmp, config, markers, tmp / "run" / "agents", tmp / "log" / "hook.log")
    installed: dict[Path, bytes] = {}
    try:
        done = subprocess.run([str(REPO / "scripts" / "install.sh"), "--hook-only", "--python", sys.executable,
                               "--config", str(config)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr + done.stdout
        print(done.stdout)
        installed.update({p: p.read_bytes() for p in (HOOKS_DIR / "qemu", HOOKS_DIR / "qemu.d" / "vmcache")
                          if _our_hook(p)})
        yield e
    finally:
        try:
            cleanup = libvirt.open(URI)  # a fresh connection: the test's may be broken
            for dom in cleanup.listAllDomains():
                if dom.name().startswith(PREFIX):
                    for undo in (dom.destroy, dom.undefine):
                        try:
                            undo()
                        except libvirt.libvirtError:
                            pass
            cleanup.close()
        finally:
            kill_agents(str(e.agents))
        # remove our hook and put back what was there - unless another test replaced it meanwhile:
        # then it is that test's, and left alone
        for path, content in installed.items():
            if path.exists() and path.read_bytes() == content:
                path.unlink()
                if path in backups:
                    path.write_bytes(backups[path])
                    path.chmod(0o755)
        try:
            conn.close()
        except libvirt.libvirtError:
            pass
        shutil.rmtree(tmp, ignore_errors=True)
        os.close(lock)


def domain_xml(env: Env, name: str, *, opted_in: bool) -> str:
    disk = env.tmp / f"{name}.raw"
    with open(disk, "wb") as f:
        f.truncate(16 << 20)
    meta = (f"<metadata><vmcache:cache xmlns:vmcache='{NAMESPACE}' budget='8M'/></metadata>" if opted_in else "")
    return f"""<domain type='qemu'>
  <name>{name}</name>
  <uuid>{uuidlib.uuid4()}</uuid>
  <memory unit='MiB'>32</memory>
  <vcpu>1</vcpu>
  {meta}
  <os><type arch='x86_64'>hvm</type></os>
  <devices>
    <emulator>/usr/bin/qemu-system-x86_64</emulator>
    <disk type='file' device='disk'>
      <driver name='qemu' type='raw' cache='writethrough'/>
      <source file='{disk}'/>
      <target dev='vda' bus='virtio'/>
    </disk>
  </devices>
</domain>"""


def start(env: Env, name: str, *, opted_in: bool):
    return env.conn.createXML(domain_xml(env, name, opted_in=opted_in), libvirt.VIR_DOMAIN_START_PAUSED)


def agent_pid(env: Env, name: str) -> int:
    record = json.loads(wait_for(lambda: env.started(name).exists() and env.started(name).read_text(),
                                 f"the agent of {name}"))
    return record["pid"]


def hook_log(env: Env) -> str:
    return env.log.read_text() if env.log.exists() else ""


def test_opted_in_domain_gets_an_agent_that_stops_with_it(env: Env):
    name = PREFIX + "on"
    dom = start(env, name, opted_in=True)
    pid = agent_pid(env, name)
    record = json.loads(env.started(name).read_text())
    assert record["argv"][-4:] == ["--host-config", str(env.config), "--domain", name]
    assert pidfile_holder(str(env.agents / (file_stem(name) + ".pid"))) == pid
    assert f"hook.start domain={name} op=started" in hook_log(env)
    # the agent is detached from libvirtd: not its child, stdin is /dev/null
    assert record["ppid"] != env_libvirtd_pid()
    assert os.readlink(f"/proc/{pid}/fd/0") == "/dev/null"
    # virsh destroy: the stopped/release hook stops it
    dom.destroy()
    stopped = json.loads(wait_for(lambda: env.stopped(name).exists() and env.stopped(name).read_text(),
                                  "the agent to be stopped"))
    assert stopped == {"pid": pid, "signal": "TERM"}
    assert f"hook.stop domain={name} op=stopped" in hook_log(env)


def env_libvirtd_pid() -> int:
    return int(Path("/run/libvirtd.pid").read_text().strip()) if Path("/run/libvirtd.pid").exists() else -1


def test_domain_without_metadata_gets_none_until_enabled_live(env: Env, capsys):
    name = PREFIX + "off"
    dom = start(env, name, opted_in=False)
    # createXML returns after the started hook ran: its decision is logged by then
    wait_for(lambda: f'hook.ignore domain={name} op=started reason="no vmcache metadata"' in hook_log(env),
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
    assert f"domain={name} op=restore" not in hook_log(env)  # filters are silent
    restored.destroy()
