"""The agent's link to its domain in libvirt: connection, lookup, events, XML, QMP monitor.

libvirt's errors are translated here into DomainError. libvirtd may go away
(restart, upgrade) while the domain keeps running: :meth:`DomainLink.attach`
is called again to reconnect, and the workers get the new :meth:`monitor`.

An agent belongs to one *run* of its domain (one QEMU process), named by
libvirt's domain id, which changes at every start: the hook passes the id
of the run it starts the agent for. libvirt finds a domain by name or uuid
whatever its run, so the link checks the run before every QMP command
and holds the run's gate until the reply (:meth:`sending`,
:mod:`vmcache.host.rungate`): after a fast ``destroy``/``start`` the old
run's agent must not clean up, or do anything else, in the new QEMU.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import libvirt

from ..errors import DomainError, MonitorBusyError, MonitorConnectionError, MonitorRunOverError, RunEndedError
from ..host.qmp import LibvirtMonitor
from ..host.rungate import RunGate
from ..host.virtdomain import VirtDomain
from ..host.virtevents import DomainEvents, EventLoop, Pending
from ..settings.metadata import DomainInfo, parse_domain

__all__ = ["DomainLink"]

#: Seconds a QMP command waits for libvirt to end a job of the domain before it is not sent, and how often it looks.
BUSY_WAIT = 2.0
BUSY_POLL = 0.05
#: (state, reason) of a domain on the destination of a migration until the migration ends.
_INCOMING = (libvirt.VIR_DOMAIN_PAUSED, libvirt.VIR_DOMAIN_PAUSED_MIGRATION)


class DomainLink:
    """One run of a domain on a libvirt connection opened with ``connect(uri)``.

    ``domain_id`` is the run's libvirt id; None binds the link to the run
    found at the first :meth:`attach` (an agent started by hand or by systemd).
    ``gate``: the run's fence against the next run's start (None: the run
    check alone).
    """

    def __init__(self, domain: str, uri: str, *, connect: Callable[[str], Any], wake: threading.Event,
                 domain_id: int | None = None, gate: RunGate | None = None) -> None:
        self.domain = domain
        self.domain_id = domain_id
        self.gate = gate
        self.uri = uri
        self._connect = connect
        self._wake = wake
        self._conn: Any = None
        self._dom: Any = None
        self._events: DomainEvents | None = None
        self._held_back = False  # the last command was not sent: the domain's job was still running
        self.uuid = ""  # known once attached
        #: (uid, gid) QEMU runs as, from the DAC seclabel (known once attached; None: not said)
        self.qemu_user: tuple[int, int] | None = None

    def attach(self) -> DomainInfo:
        """Connect, look the domain up, subscribe to its events; its XML.

        Raises RunEndedError when the domain no longer runs as the run the
        link is bound to, DomainError (libvirt) or ConfigError (its metadata
        is not acceptable).
        """
        self.close()
        EventLoop.ensure()  # libvirt delivers events only if its loop runs before the connection opens
        self._conn = self._connect(self.uri)
        try:
            self._dom = self._conn.lookupByName(self.domain)
        except libvirt.libvirtError as err:
            raise DomainError(f"domain {self.domain!r}: {err.get_error_message()}") from err
        run = self._current_run()
        if self.domain_id is None and run is not None:
            self.domain_id = run
        if run is None or run != self.domain_id:
            raise RunEndedError(f"domain {self.domain!r}: run {self.domain_id} is over"
                                + (f" (it runs as {run} now)" if run is not None else ""))
        self._events = DomainEvents(self._conn, self._dom, self._wake)
        info = self.read_xml()
        self.uuid = info.uuid
        self.qemu_user = info.qemu_user
        return info

    def read_xml(self) -> DomainInfo:
        """The domain's live XML, parsed. Raises DomainError or ConfigError."""
        try:
            xml = self._dom.XMLDesc(0)
        except libvirt.libvirtError as err:
            raise DomainError(f"domain {self.domain!r}: cannot read XML: {err.get_error_message()}") from err
        return parse_domain(xml)

    def poll(self) -> Pending:
        """The events since the previous poll (none while not subscribed)."""
        return self._events.poll() if self._events else Pending()

    def _current_run(self) -> int | None:
        """The id of the domain's current run, asked anew (a virDomain keeps the id it was looked up with)."""
        if self._conn is None:
            return None
        try:
            run = self._conn.lookupByName(self.domain).ID()
        except libvirt.libvirtError:  # undefined (a transient domain that stopped), or libvirtd gone
            return None
        return int(run) if run is not None and run >= 0 else None

    def incoming(self) -> bool:
        """True while the run is still coming in by a migration (libvirt holds the domain's job until it
        ends: a QMP command would wait for it, 30 s at most). Raises DomainError."""
        try:
            if tuple(self._dom.state()) != _INCOMING:
                return False
        except libvirt.libvirtError as err:
            raise DomainError(f"domain {self.domain!r}: cannot get its state: {err.get_error_message()}") from err
        # A domain restored paused stays (paused, migration) for good. What only an incoming migration's
        # destination does: refuse job statistics ("available only on the source host"), before any job
        # lock is taken (qemuDomainGetJobStatsInternal), so the question never waits.
        try:
            self._dom.jobInfo()
        except libvirt.libvirtError as err:
            if err.get_error_code() == libvirt.VIR_ERR_OPERATION_UNSUPPORTED:
                return True
            raise DomainError(f"domain {self.domain!r}: cannot get its job: {err.get_error_message()}") from err
        return False

    def alive(self) -> bool:
        """True while the domain runs as the link's run (False when it stopped, restarted, or libvirtd cannot tell)."""
        return self.domain_id is not None and self._current_run() == self.domain_id

    def check_run(self) -> None:
        """Raise MonitorRunOverError unless the domain still runs as the link's run (before each QMP command)."""
        if not self.alive():
            raise MonitorRunOverError(f"domain {self.domain!r}: run {self.domain_id} is not running;"
                                      " command not sent")

    def open_gate(self) -> None:
        """Make the run's gate (once the run is claimed: only its agent has one), then check the run again.

        A start of a new run before the gate existed was not fenced, but the
        check sees it; one after removes the gate. Made once: a reattach must
        not undo a fence. Raises RunEndedError, HostError.
        """
        if self.gate is None or self.gate.path is not None or self.domain_id is None:
            return
        self.gate.open(self.uuid, self.domain_id)
        if self._current_run() != self.domain_id:
            raise RunEndedError(f"domain {self.domain!r}: run {self.domain_id} is over")

    @contextmanager
    def sending(self) -> Iterator[None]:
        """Around one QMP command: check the run, wait (a little) for libvirt to be done with the domain's
        job, and hold the run's gate until the reply.

        A command sent while libvirt runs a job of the domain waits for the
        job, up to libvirt's 30 s; a snapshot revert's job runs the hook
        that fences this run, and that fence waits for this command: so a
        command is sent only while the domain has no job, after up to
        BUSY_WAIT seconds of waiting with no gate held (the first command
        held back by a job waits; the next ones, until one goes, do not).
        Raises MonitorBusyError, MonitorConnectionError.
        """
        self.check_run()  # before the gate: a lookup may wait for libvirtd, which may be running the fencing hook
        deadline = time.monotonic() + (0.0 if self._held_back else BUSY_WAIT)  # one wait per job, not per command
        while self._busy() and time.monotonic() < deadline:
            time.sleep(BUSY_POLL)
        with self.gate.hold() if self.gate is not None else nullcontext():
            job = self._busy()
            self._held_back = job is not None
            if job is not None:
                raise MonitorBusyError(f"domain {self.domain!r}: libvirt is busy with a job of it ({job}); "
                                       "command not sent")
            yield

    def _busy(self) -> str | None:
        """The libvirt job running on the domain (VirtDomain.job), None when commands can go. Raises
        MonitorConnectionError when the domain stopped."""
        try:
            return VirtDomain.of(self._dom).job()
        except DomainError as err:
            if not self.alive():
                raise MonitorRunOverError(f"{err}; command not sent") from err
            raise MonitorConnectionError(f"{err}; command not sent") from err

    def connected(self) -> bool:
        """True when libvirtd still answers on this connection."""
        try:
            self._conn.getLibVersion()
        except Exception:  # noqa: BLE001 - any failure here means the connection is gone
            return False
        return True

    def virt(self) -> VirtDomain:
        """The domain's metadata facade (the saved hot set), on the current connection."""
        return VirtDomain.of(self._dom)

    def monitor(self) -> LibvirtMonitor:
        """The domain's QMP monitor, through libvirt."""
        return LibvirtMonitor(self._dom, guard=self.sending)

    def end(self) -> None:
        """As the agent exits, its QMP commands done: unsubscribe, and remove the run's gate."""
        self.close()
        if self.gate is not None:
            self.gate.remove()

    def close(self) -> None:
        """Unsubscribe from the domain's events (the connection is dropped with it)."""
        if self._events:
            self._events.close()
            self._events = None
