"""A live migration between the two hosts of tests/host/migrate.sh, as the checks and the bench drive it.

tests/host/test_migrate_hosts.py (the checks) and bench/migrate_bench.py
(the benchmark) both define the test guest on host A, watch its agent on
each host and migrate it as an operator does, on the source::

    virsh migrate --live --p2p --persistent --undefinesource --unsafe DOMAIN qemu+tcp://DEST/system

(--unsafe: libvirt 9.0 does not know a bind mount for shared storage;
docs/reliability.md). Lifecycle events (the moment a migration ends on each
side) need libvirt's default event loop registered before the first
connection: :func:`start_events` does it once, :func:`open_sides` then
opens both hosts and records every lifecycle event each one sends.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import libvirt

from tests.host.twohosts import Host, mounts_from_env, plain_from_env, shared_from_env
from tests.lab import GuestSpec, domain_xml
from tests.live.livelib import destroy_on, wait_for
from vmcache.host.cachestat import cachestat
from vmcache.host.files import file_stem
from vmcache.service.systemdunit import systemd_escape

__all__ = ["MIGRATE", "Side", "agent_running", "close_sides", "console", "define_guest", "guest_ready", "lines",
           "migrate", "open_sides", "remove_domains", "resident", "resume_time", "start_events", "status", "unit_of"]

MiB = 1 << 20
MIGRATE = "virsh migrate --live --p2p --persistent --undefinesource --unsafe"

_events_started = False


def start_events() -> None:
    """libvirt's default event loop, run in a daemon thread (once: later calls do nothing); it also runs the
    connections' keepalive."""
    global _events_started
    if _events_started:
        return
    libvirt.virEventRegisterDefaultImpl()
    libvirt.registerErrorHandler(lambda _c, _e: None, None)

    def run() -> None:
        while True:
            libvirt.virEventRunDefaultImpl()

    threading.Thread(target=run, daemon=True, name="libvirt-events").start()
    _events_started = True


@dataclass
class Side:
    """One host as the checks use it: the host, a libvirt connection, the lifecycle events seen on it."""

    host: Host
    conn: Any
    events: list[tuple[float, str, int, int]] = field(default_factory=list)

    def event_time(self, name: str, kind: int, detail: int) -> float | None:
        """When (wall time, as this machine got it) the first event ``kind``/``detail`` of ``name`` came."""
        return next((t for t, n, k, d in self.events if (n, k, d) == (name, kind, detail)), None)


def open_sides(hosts: tuple[Host, Host]) -> tuple[Side, Side]:
    """Both hosts connected, each recording its lifecycle events (starts the event loop first)."""
    start_events()
    pair = tuple(Side(host, host.connect()) for host in hosts)
    for side in pair:
        side.conn.domainEventRegisterAny(
            None, libvirt.VIR_DOMAIN_EVENT_ID_LIFECYCLE,
            lambda _c, dom, kind, detail, s: s.events.append((time.time(), dom.name(), kind, detail)), side)
    return pair[0], pair[1]


def remove_domains(sides: tuple[Side, Side], prefix: str) -> None:
    """Destroy and undefine every domain named ``prefix``... on both hosts (libvirt errors: it is gone)."""
    for side in sides:
        destroy_on(side.conn, prefix)


def close_sides(sides: tuple[Side, Side], prefix: str) -> None:
    """Remove the domains named ``prefix``... (:func:`remove_domains`), then close both connections."""
    remove_domains(sides, prefix)
    for side in sides:
        side.conn.close()


def define_guest(side: Side, name: str, *, metadata: str = "", workload: str = "idle", image: str | None = None,
                 **spec: Any) -> Any:
    """The test guest (``workload``, idle by default) defined (not started) on ``side``, its disk in the shared
    directory: ``image`` (a file there, used as it is) or, by default, a new 64 MiB ``NAME.raw``;
    ``metadata``: elements for its ``<metadata>``; ``spec``: more GuestSpec fields."""
    here, there = shared_from_env()
    plain, plain_there = plain_from_env()
    if image is None:
        image = f"{name}.raw"
        with open(here / image, "wb") as f:
            f.truncate(64 * MiB)
    (plain / f"{name}.console").unlink(missing_ok=True)
    fields = {"loops": 0, "guest_dir": f"{plain_there}/guest", **spec}
    xml = domain_xml(GuestSpec(name=name, disk=f"{there}/{image}", console_log=f"{plain_there}/{name}.console",
                               workload=workload, console_append=True, **fields))
    if metadata:
        xml = xml.replace("</name>", f"</name>\n  <metadata>{metadata}</metadata>", 1)
    return side.conn.defineXML(xml)


def console(name: str) -> str:
    """What the guest printed on its serial console so far (on A, then on B: one file both append to)."""
    plain, _ = plain_from_env()
    try:
        return (plain / f"{name}.console").read_text(errors="replace")
    except FileNotFoundError:
        return ""


def guest_ready(name: str) -> None:
    wait_for(lambda: "VMCACHE-GUEST-READY" in console(name), f"{name}'s guest to boot", timeout=120, step=0.5)


def resident(side: int, name: str, start: int, length: int, *, image: str | None = None) -> int:
    """Bytes of ``[start, start + length)`` of the image (``image``, default ``NAME.raw``) in host ``side``'s
    page cache (0: A, 1: B), as its own mount of the shared directory has them."""
    fd = os.open(mounts_from_env()[side] / (image or f"{name}.raw"), os.O_RDONLY)
    try:
        return int(cachestat(fd, start, length).nr_cache) * 4096
    finally:
        os.close(fd)


def unit_of(name: str) -> str:
    return f"vmcache-agent@{systemd_escape(name)}.service"


def status(host: Host, name: str) -> Any:
    """The status file of ``name``'s agent on ``host`` (None: none, or half written)."""
    try:
        return json.loads(host.path(f"/run/vmcache/agents/{file_stem(name)}.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def agent_running(host: Host, name: str) -> Any:
    """Waits for the hook's unit to run the agent and its first cycle; its status."""
    unit = unit_of(name)
    wait_for(lambda: host.unit(unit)["ActiveState"] == "active", f"the hook on {host.name} to start {unit}")
    return wait_for(lambda: (s := status(host, name)) and s["state"] == "running" and s["disks"] and s,
                    f"the first cycle of {unit} on {host.name}")


def lines(host: Host, name: str, event: str) -> list[tuple[float, str]]:
    """(time, message) of the agent's log lines of ``event`` on ``host``."""
    return [(t, m) for t, m in host.journal(unit_of(name)) if f" {event} " in f"{m} "]


def migrate(src: Side, dst: Side, name: str, options: str = "", timeout: float = 120.0) -> float:
    """Live-migrate ``name`` from ``src`` to ``dst`` as an operator does, on ``src`` (``options``: more virsh
    migrate options); the seconds it took."""
    started = time.monotonic()
    src.host.run("sh", "-c", f"{MIGRATE} {options} {name} qemu+tcp://{dst.host.name}/system", timeout=timeout)
    return time.monotonic() - started


def resume_time(b: Side, name: str) -> float:
    """When ``name`` resumed on ``b`` after coming in (its VIR_DOMAIN_EVENT_RESUMED_MIGRATED; waits for it)."""
    return wait_for(lambda: b.event_time(name, libvirt.VIR_DOMAIN_EVENT_RESUMED, libvirt.VIR_DOMAIN_EVENT_RESUMED_MIGRATED),
                    "B's resume event")
