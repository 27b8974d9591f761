"""The agent's link to its domain in libvirt: connection, lookup, events, XML, QMP monitor.

libvirt's errors are translated here into DomainError. libvirtd may go away
(restart, upgrade) while the domain keeps running: :meth:`DomainLink.attach`
is called again to reconnect, and the workers get the new :meth:`monitor`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import libvirt

from ..errors import DomainError
from ..host.qmp import LibvirtMonitor
from ..host.virtdomain import VirtDomain
from ..host.virtevents import DomainEvents, EventLoop, Pending
from ..settings.metadata import DomainInfo, parse_domain

__all__ = ["DomainLink"]


class DomainLink:
    """One domain, by name, on a libvirt connection opened with ``connect(uri)``."""

    def __init__(self, domain: str, uri: str, *, connect: Callable[[str], Any], wake: threading.Event) -> None:
        self.domain = domain
        self.uri = uri
        self._connect = connect
        self._wake = wake
        self._conn: Any = None
        self._dom: Any = None
        self._events: DomainEvents | None = None
        self.uuid = ""  # known once attached

    def attach(self) -> DomainInfo:
        """Connect, look the domain up, subscribe to its events; its XML.

        Raises DomainError (libvirt) or ConfigError (its metadata is not acceptable).
        """
        self.close()
        EventLoop.ensure()  # libvirt delivers events only if its loop runs before the connection opens
        self._conn = self._connect(self.uri)
        try:
            self._dom = self._conn.lookupByName(self.domain)
        except libvirt.libvirtError as err:
            raise DomainError(f"domain {self.domain!r}: {err.get_error_message()}") from err
        self._events = DomainEvents(self._conn, self._dom, self._wake)
        info = self.read_xml()
        self.uuid = info.uuid
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

    def alive(self) -> bool:
        """True while the domain runs (False when it stopped or libvirtd cannot tell)."""
        try:
            return bool(self._dom is not None and self._dom.isActive())
        except libvirt.libvirtError:
            return False

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
        return LibvirtMonitor(self._dom)

    def close(self) -> None:
        """Unsubscribe from the domain's events (the connection is dropped with it)."""
        if self._events:
            self._events.close()
            self._events = None
