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
import libvirt_qemu  # noqa: E402

from vmcache.cli import main  # noqa: E402
from vmcache.launcher import pidfile_holder  # noqa: E402
from vmcache.metadata import NAMESPACE  # noqa: E402
from vmcache.status import file_stem  # noqa: E402

from tests.pagecache_util import vmlck  # noqa: E402

pytestmark = pytest.mark.live

REPO = Path(__file__).resolve().parents[2]
URI = "qemu:///system"
HOOKS_DIR = Path("/etc/libvirt/hooks")
PREFIX = f"vmcache-test-agent-{os.getpid()}-"
MiB = 1 << 20
CAP = 24 * MiB


@dataclass
class Env:
    conn: object
    tmp: Path
    config: Path

    @property
    def agents(self) -> Path:
        return self.tmp / "run" / "agents"

    def status(self, name: str) -> dict | None:
        path = self.agents / (file_stem(name) + ".json")
        try:
            return json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def agent_pid(self, name: str) -> int | None:
        return pidfile_holder(str(self.agents / (file_stem(name) + ".pid")))


def wait_for(predicate, what: str, timeout: float = 30.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _our_hook(path: Path) -> bool:
    return path.is_file() and "vmcache-hook" in path.read_text(errors="replace")


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> Iterator[Env]:  # type: ignore[no-untyped-def]
    if os.geteuid() != 0:
        pytest.skip("needs root")
    libvirt.registerErrorHandler(lambda _c, _e: None, None)
    try:
        conn = libvirt.open(URI)
    except libvirt.libvirtError:
        pytest.skip("libvirtd does not answer on qemu:///system (scripts/libvirtd.sh starts it)")
    tmp = tmp_path_factory.mktemp("agent-live")
    tmp.chmod(0o755)
    config = tmp / "vmcache.yaml"
    config.write_text(
        f"runtime_dir: {tmp}/run\nlog_dir: {tmp}/log\ninterval: 1s\nmin_free: 256M\n"
        f"pinned_cap: {CAP}\n"
        f"agent_command: [{sys.executable}, -m, vmcache, agent]\n"
        "model:\n  decay: 0.5\n  block_size: 1M\n"
    )
    backups = {p: p.read_bytes() for p in (HOOKS_DIR / "qemu", HOOKS_DIR / "qemu.d" / "vmcache") if _our_hook(p)}
    e = Env(conn, tmp, config)
    try:
        done = subprocess.run([str(REPO / "scripts" / "install.sh"), "--hook-only", "--python", sys.executable,
                               "--config", str(config)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr + done.stdout
        yield e
    finally:
        for dom in conn.listAllDomains():
            if dom.name().startswith(PREFIX):
                try:
                    dom.destroy()
                except libvirt.libvirtError:
                    pass
        for pidfile in (tmp / "run" / "agents").glob("*.pid") if (tmp / "run" / "agents").exists() else []:
            pid = pidfile_holder(str(pidfile))
            if pid:
                os.kill(pid, 9)
        subprocess.run([str(REPO / "scripts" / "install.sh"), "--hook-only", "--uninstall", "--no-reload"],
                       capture_output=True, timeout=60)
        for path, content in backups.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content)
            path.chmod(0o755)
        conn.close()
        shutil.rmtree(tmp, ignore_errors=True)


def start(env: Env, name: str, *, budget: str | None, size: int = 64 * MiB):  # type: ignore[no-untyped-def]
    disk = env.tmp / f"{name}.raw"
    with open(disk, "wb") as f:
        f.truncate(size)
    meta = (f"<metadata><vmcache:cache xmlns:vmcache='{NAMESPACE}' budget='{budget}'/></metadata>"
            if budget else "")
    xml = f"""<domain type='qemu'>
  <name>{name}</name>
  <uuid>{uuidlib.uuid4()}</uuid>
  <memory unit='MiB'>32</memory>
  <vcpu>1</vcpu>
  {meta}
  <os><type arch='x86_64'>hvm</type></os>
  <devices>
    <disk type='file' device='disk'>
      <driver name='qemu' type='raw' cache='writethrough'/>
      <source file='{disk}'/>
      <target dev='vda' bus='virtio'/>
      <alias name='ua-vda'/>
    </disk>
  </devices>
</domain>"""
    return env.conn.createXML(xml, libvirt.VIR_DOMAIN_START_PAUSED)


def guest_write(dom, offset: int, length: int) -> None:  # type: ignore[no-untyped-def]
    """Write through the virtio device as the guest would (HMP qemu-io)."""
    out = libvirt_qemu.qemuMonitorCommand(
        dom, f'qemu-io -d /machine/peripheral/ua-vda/virtio-backend "write -P 0xab {offset} {length}"',
        libvirt_qemu.VIR_DOMAIN_QEMU_MONITOR_COMMAND_HMP)
    assert "wrote" in out or not out.strip(), out  # HMP qemu-io prints nothing on success here


def qemu_leftovers(dom) -> dict:  # type: ignore[no-untyped-def]
    """Bitmaps, nodes and exports of vmcache's still in QEMU."""
    def qmp(cmd: str, args: dict | None = None):  # type: ignore[no-untyped-def]
        msg = {"execute": cmd, **({"arguments": args} if args else {})}
        return json.loads(libvirt_qemu.qemuMonitorCommand(dom, json.dumps(msg), 0))["return"]
    nodes = qmp("query-named-block-nodes", {"flat": True})
    return {
        "bitmaps": [b["name"] for n in nodes for b in n.get("dirty-bitmaps", []) if b["name"].startswith("vmcache")],
        "nodes": [n["node-name"] for n in nodes if n["node-name"].startswith("vmcache")],
        "exports": [e["id"] for e in qmp("query-block-exports")],
    }


def test_hook_starts_the_agent_which_tracks_writes_pins_and_stops_with_the_domain(env: Env) -> None:
    name = PREFIX + "main"
    dom = start(env, name, budget="16M")
    pid = wait_for(lambda: env.agent_pid(name), "the hook to start the agent")
    wait_for(lambda: (s := env.status(name)) and s["state"] == "running", "the agent's first cycle")
    status = env.status(name)
    assert [(d["target"], d["cache"], d["eligible"]) for d in status["disks"]] == [("vda", "writethrough", True)]
    assert wait_for(lambda: qemu_leftovers(dom)["bitmaps"], "the agent's dirty bitmap in QEMU")

    guest_write(dom, 8 * MiB, 4 * MiB)
    status = wait_for(lambda: (s := env.status(name)) and s["disks"][0]["pinned_bytes"] >= 4 * MiB and s,
                      "the written region to be pinned")
    assert status["disks"][0]["pinned_bytes"] <= 16 * MiB
    metrics = wait_for(lambda: _scrape(status["metrics_url"], "vmcache_guest_written_bytes_total"), "metrics")
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


def test_disable_stops_the_agent_and_leaves_nothing_in_qemu(env: Env, capsys) -> None:  # type: ignore[no-untyped-def]
    name = PREFIX + "off"
    dom = start(env, name, budget=None)
    time.sleep(1)
    assert env.agent_pid(name) is None  # no metadata: no agent
    assert main(["enable", name, "--budget", "8M", "--live", "--host-config", str(env.config)]) == 0
    wait_for(lambda: (s := env.status(name)) and s["state"] == "running", "vmcache enable to start an agent")
    guest_write(dom, 0, 2 * MiB)
    wait_for(lambda: env.status(name)["disks"][0]["pinned_bytes"] >= 2 * MiB, "a pin")
    assert qemu_leftovers(dom)["bitmaps"]

    assert main(["disable", name, "--live", "--host-config", str(env.config)]) == 0
    wait_for(lambda: env.agent_pid(name) is None, "the agent to exit once disabled")
    assert qemu_leftovers(dom) == {"bitmaps": [], "nodes": [], "exports": []}
    nbd = env.tmp / "run" / "nbd"
    assert not (list(nbd.rglob("*")) if nbd.exists() else []), list(nbd.rglob("*"))
    dom.destroy()


def test_two_domains_together_respect_the_host_wide_cap(env: Env) -> None:
    names = [PREFIX + "cap-a", PREFIX + "cap-b"]
    doms = [start(env, n, budget="32M") for n in names]
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


def _scrape(url: str, metric: str) -> float | None:
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    text = urlopen(url, timeout=5).read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == metric:
                return sample.value or None
    return None
