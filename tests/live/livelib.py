"""Plumbing shared by the live tests and bench/soak.py: libvirtd, test domains, agents.

Everything here touches the host (libvirtd, agent processes); nothing
imports pytest, so bench/soak.py uses it too. Pytest fixtures built on it
are in tests/live/conftest.py. :meth:`LiveEnv.domain` is the one way the
live tests build their domains. What the guest does through QEMU is in
tests/live/guestlib.py, the test hook's installation in
tests/live/hooklib.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid as uuidlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar
from xml.sax.saxutils import escape

import libvirt

from vmcache.host.files import lock_holder
from vmcache.settings.metadata import NAMESPACE
from vmcache.host.files import file_stem

__all__ = [
    "agents_env", "cache_metadata", "connect", "create_disk", "destroy_domains", "destroy_on", "domain_xml", "GiB",
    "libvirtd_pid", "LiveEnv", "loop_device", "MiB", "nbd_dir", "open_conn", "qemu_pid", "read_status", "REPO",
    "restart_libvirtd", "scrape", "start_paused", "stop_agents", "URI", "wait_for"
]

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[2]
URI = "qemu:///system"
LIBVIRTD_PIDFILE = Path("/run/libvirtd.pid")
MiB = 1 << 20
GiB = 1 << 30


def wait_for(predicate: Callable[..., T | Literal[False] | None], what: str, timeout: float = 30.0,
             step: float = 0.1) -> T:
    """Poll ``predicate`` every ``step`` s until it returns something true; that value.

    Raises AssertionError naming ``what`` after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


# -- libvirtd ---------------------------------------------------------------------------------


def open_conn() -> Any:
    """A connection to qemu:///system, or None when libvirtd does not answer."""
    try:
        return libvirt.open(URI)
    except libvirt.libvirtError:
        return None


def connect(timeout: float = 30.0) -> Any:
    """A connection to qemu:///system, waiting up to ``timeout`` s for libvirtd; AssertionError if none."""
    return wait_for(open_conn, "libvirtd to answer", timeout=timeout)


def libvirtd_pid() -> int:
    """The pid of the running libvirtd (from its pidfile); -1 when there is none."""
    return int(LIBVIRTD_PIDFILE.read_text().strip()) if LIBVIRTD_PIDFILE.exists() else -1


def restart_libvirtd() -> None:
    """Stop libvirtd (SIGTERM: running domains stay) and start it again with scripts/libvirtd.sh.

    Connections opened before are dead afterwards. Raises AssertionError when
    libvirtd does not exit or does not start.
    """
    pid = libvirtd_pid()
    os.kill(pid, signal.SIGTERM)
    wait_for(lambda: not os.path.exists(f"/proc/{pid}"), "libvirtd to exit", timeout=30)
    done = subprocess.run([str(REPO / "scripts" / "libvirtd.sh")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def qemu_pid(name: str) -> int:
    """The pid of the QEMU process of running domain ``name``."""
    return int(Path(f"/run/libvirt/qemu/{name}.pid").read_text().strip())


# -- domains ----------------------------------------------------------------------------------


def cache_metadata(budget: str | None) -> str:
    """The ``<metadata>`` element that opts a domain in with ``budget``; empty for None."""
    return f"<metadata><vmcache:cache xmlns:vmcache='{NAMESPACE}' budget='{budget}'/></metadata>" if budget else ""


def create_disk(path: Path, size: int) -> Path:
    """A sparse raw image of ``size`` bytes at ``path``."""
    with open(path, "wb") as f:
        f.truncate(size)
    return path


@contextmanager
def loop_device(backing: Path, size: int) -> Iterator[str]:
    """A loop device over a sparse file ``backing`` of ``size`` bytes; detached afterwards."""
    create_disk(backing, size)
    dev = subprocess.run(["losetup", "--find", "--show", str(backing)], capture_output=True, text=True,
                         check=True).stdout.strip()
    try:
        yield dev
    finally:
        subprocess.run(["losetup", "-d", dev], check=False)


def domain_xml(name: str, disk: Path, *, metadata: str = "", devices: str = "") -> str:
    """A small TCG domain: 32 MiB, one vCPU, ``disk`` as a writethrough raw virtio vda (alias ua-vda).

    ``metadata`` goes in as it is (see :func:`cache_metadata`), and so do
    extra ``devices``. No guest OS is needed: the domain is started paused.
    """
    return f"""<domain type='qemu'>
  <name>{escape(name)}</name>
  <uuid>{uuidlib.uuid4()}</uuid>
  <memory unit='MiB'>32</memory>
  <vcpu>1</vcpu>
  {metadata}
  <os><type arch='x86_64'>hvm</type></os>
  <devices>
    <disk type='file' device='disk'>
      <driver name='qemu' type='raw' cache='writethrough'/>
      <source file='{escape(str(disk))}'/>
      <target dev='vda' bus='virtio'/>
      <alias name='ua-vda'/>
    </disk>
    {devices}
  </devices>
</domain>"""


def start_paused(conn: Any, xml: str) -> Any:
    """Start a transient domain from ``xml``, paused; its virDomain. Raises libvirtError."""
    return conn.createXML(xml, libvirt.VIR_DOMAIN_START_PAUSED)


def destroy_domains(prefix: str) -> None:
    """:func:`destroy_on` a fresh connection; never raises for libvirt errors (it runs in teardowns, after failures)."""
    conn = open_conn()
    if conn is not None:
        destroy_on(conn, prefix)
        with contextlib.suppress(libvirt.libvirtError):
            conn.close()


def destroy_on(conn: Any, prefix: str) -> None:
    """Destroy (and undefine) every domain of ``conn`` whose name starts with ``prefix``; never raises for
    libvirt errors."""
    try:
        for dom in conn.listAllDomains():
            if dom.name().startswith(prefix):
                for undo in (dom.destroy, dom.undefine):
                    try:
                        undo()
                    except libvirt.libvirtError:
                        pass
    except libvirt.libvirtError:
        pass


# -- agents -----------------------------------------------------------------------------------


def scrape(url: str, metric: str, labels: dict[str, str] | None = None) -> float:
    """The sum of the samples of ``metric`` (with ``labels``) at ``url``; 0 when there are none."""
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    text = urlopen(url, timeout=5).read().decode()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == metric and all(sample.labels.get(k) == v for k, v in (labels or {}).items()):
                total += sample.value
    return total


def read_status(agents: Path, name: str) -> Any:
    """The status file of ``name``'s agent in ``agents`` (its JSON document); None when absent or half written."""
    try:
        return json.loads((agents / (file_stem(name) + ".json")).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def nbd_dir(runtime: Path, name: str) -> Path:
    """The NBD socket directory of ``name``'s agent."""
    from vmcache.host.files import nbd_dir as agent_nbd_dir

    return Path(agent_nbd_dir(str(runtime), name))


def stop_agents(agents: Path, grace: float = 10.0) -> None:
    """SIGTERM every agent holding a pidfile lock in ``agents``, SIGKILL those still there after ``grace`` s.

    Also stops agents the hook started for other running domains (libvirtd's
    reconnect calls). Never raises for agents already gone.
    """
    if not agents.exists():
        return
    deadline = time.monotonic() + grace
    for pidfile in agents.glob("*.pid"):
        while (pid := lock_holder(str(pidfile))) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)  # being started: it records its pid just before its exec
        if pid:
            _signal(pid, signal.SIGTERM)
        while (pid := lock_holder(str(pidfile))) and time.monotonic() < deadline:
            time.sleep(0.1)
        if pid:
            _signal(pid, signal.SIGKILL)


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


@dataclass
class LiveEnv:
    """A host config under ``tmp`` (runtime_dir tmp/run, log_dir tmp/log), its agents' files, and the test domains.

    ``base`` is the host config as written (:meth:`write_config`); :meth:`domain` builds and starts every
    test domain the same way and remembers it for :meth:`cleanup`.
    """

    conn: Any
    tmp: Path
    config: Path
    base: dict[str, Any] = field(default_factory=dict)
    made: list[str] = field(default_factory=list)  # names of the domains domain() made, for cleanup()

    @property
    def run(self) -> Path:
        return self.tmp / "run"

    @property
    def agents(self) -> Path:
        return self.run / "agents"

    @property
    def logs(self) -> Path:
        return self.tmp / "log"

    def write_config(self, **changes: object) -> None:
        """The host config file: ``base`` with ``changes``."""
        import yaml

        self.config.write_text(yaml.safe_dump({**self.base, **changes}))

    @contextmanager
    def config_override(self, **changes: object) -> Iterator[None]:
        """The host config with ``changes`` for agents started meanwhile (they read it once)."""
        self.write_config(**changes)
        try:
            yield
        finally:
            self.write_config()

    def live(self) -> Any:
        """The connection, opened again if libvirtd was restarted under it."""
        try:
            if self.conn is not None and self.conn.isAlive():
                return self.conn
        except libvirt.libvirtError:
            pass
        self.conn = connect(timeout=30)
        return self.conn

    def lookup(self, name: str) -> Any:
        return self.live().lookupByName(name)

    def domain(self, name: str, *, budget: str | None = "16M", metadata: str | None = None, size: int = 64 * MiB,
               image: Path | None = None, devices: str = "", persistent: bool = False,
               edit: Callable[[str], str] | None = None, start: bool = True) -> Any:
        """Test domain ``name``, started paused: the one shared way the live tests build their domains.

        Its disk is ``image`` or a fresh sparse raw image of ``size`` bytes; its metadata opts it in with
        ``budget`` (:func:`cache_metadata`), or is ``metadata`` as given ("" for none: what a fleet manager
        defines); ``devices`` are added; ``edit`` may change the XML last. Transient (created) unless
        ``persistent`` (defined, then started unless not ``start``). Remembered for :meth:`cleanup`.
        """
        xml = domain_xml(name, image or self.disk(name, size),
                         metadata=cache_metadata(budget) if metadata is None else metadata, devices=devices)
        if edit is not None:
            xml = edit(xml)
        self.made.append(name)
        if not persistent:
            return start_paused(self.live(), xml)
        dom = self.live().defineXML(xml)
        if start:
            dom.createWithFlags(libvirt.VIR_DOMAIN_START_PAUSED)
        return dom

    def cleanup(self, timeout: float = 15.0) -> None:
        """Destroy and undefine every domain :meth:`domain` made; wait for their agents (SIGKILL after ``timeout``)."""
        names, self.made[:] = list(self.made), []
        for name in names:
            try:
                dom = self.lookup(name)
            except libvirt.libvirtError:
                continue
            for undo in (dom.destroy, lambda d=dom: d.undefineFlags(_UNDEFINE_ALL)):
                try:
                    undo()
                except libvirt.libvirtError:
                    pass
        for name in names:
            try:
                wait_for(lambda n=name: self.agent_pid(n) is None, f"agent of {name} to exit", timeout=timeout)
            except AssertionError:
                if pid := self.agent_pid(name):
                    _signal(pid, signal.SIGKILL)

    def status(self, name: str) -> Any:
        """The status the domain's running agent wrote; None when none runs (a file a killed agent left is not
        its successor's)."""
        status = read_status(self.agents, name)
        return status if status and status.get("pid") == self.agent_pid(name) else None

    def agent_pid(self, name: str) -> int | None:
        return lock_holder(str(self.agents / (file_stem(name) + ".pid")))

    def agent_log(self, name: str) -> str:
        try:
            return (self.logs / f"agent-{file_stem(name)}.log").read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def hook_log(self) -> str:
        try:
            return (self.logs / "hook.log").read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def pinned(self, name: str, disk: int = 0) -> int:
        s = self.status(name)
        return s["disks"][disk]["pinned_bytes"] if s and len(s["disks"]) > disk else -1

    def disk(self, name: str, size: int) -> Path:
        """A fresh sparse raw image for domain ``name`` in ``tmp``."""
        return create_disk(self.tmp / f"{file_stem(name)}.raw", size)


_UNDEFINE_ALL = (libvirt.VIR_DOMAIN_UNDEFINE_MANAGED_SAVE | libvirt.VIR_DOMAIN_UNDEFINE_SNAPSHOTS_METADATA
                 | libvirt.VIR_DOMAIN_UNDEFINE_CHECKPOINTS_METADATA)


def agents_env(tmp: Path, hooked: Any, prefix: str, *, cap: int | str | None = None,
               **settings: object) -> Iterator[LiveEnv]:
    """A host config for fast real agents (1 s cycles, 1 MiB blocks, decay 0.5, ``cap`` pinned at most;
    ``settings`` add or replace keys) under ``tmp``, the test hook installed for it (domains ``prefix...``
    cleaned up); the LiveEnv, connected once the hook is ours (waiting for the hook lock can take minutes,
    and a connection opened before may not outlive a libvirtd restart meanwhile).

    For a module-scoped ``env`` fixture: ``yield from agents_env(live_tmp, hooked, PREFIX, cap=CAP)``.
    """
    base: dict[str, Any] = {
        "runtime_dir": f"{tmp}/run", "log_dir": f"{tmp}/log", "hotset_dir": f"{tmp}/hotsets", "interval": "1s",
        "min_free": "256M",
        "agent_command": [sys.executable, "-m", "vmcache", "agent"],
        "model": {"decay": 0.5, "block_size": "1M"},
        **({"pinned_cap": cap} if cap is not None else {}), **settings,
    }
    env = LiveEnv(None, tmp, tmp / "vmcache.yaml", base)
    env.write_config()
    hooked(env.config, prefix, env.agents)
    env.live()
    try:
        yield env
    finally:
        try:
            env.conn.close()
        except libvirt.libvirtError:
            pass
