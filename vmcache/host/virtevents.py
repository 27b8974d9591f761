"""libvirt events for the agent: lifecycle, metadata change, device add/remove, connection loss.

libvirt delivers events only to a process that registered its default
event loop implementation *before* opening a connection and keeps running
it; :class:`EventLoop` does both in a daemon thread. Callbacks run in that
thread and must only record what happened: :class:`DomainEvents` turns
them into flags the agent's own loop picks up (``poll()``), and wakes it.
"""

from __future__ import annotations

import enum
import logging
import threading
from dataclasses import dataclass
from typing import Any

import libvirt

from ..errors import DomainError
from ..logfmt import event
from ..settings.hotset import HOTSET_NAMESPACE

__all__ = ["EventLoop", "DomainEvents", "Pending"]

_LOG = logging.getLogger(__name__)


class Lifecycle(enum.IntEnum):
    """The lifecycle events the agent cares about (VIR_DOMAIN_EVENT_*)."""

    STOPPED = libvirt.VIR_DOMAIN_EVENT_STOPPED
    UNDEFINED = libvirt.VIR_DOMAIN_EVENT_UNDEFINED
    SHUTDOWN = libvirt.VIR_DOMAIN_EVENT_SHUTDOWN
    RESUMED = libvirt.VIR_DOMAIN_EVENT_RESUMED


class EventLoop:
    """libvirt's default event loop, run in a daemon thread (one per process)."""

    _started = False
    _lock = threading.Lock()

    @classmethod
    def ensure(cls) -> None:
        """Register and start the loop once; call before opening connections."""
        with cls._lock:
            if cls._started:
                return
            libvirt.virEventRegisterDefaultImpl()
            thread = threading.Thread(target=cls._run, name="libvirt-events", daemon=True)
            thread.start()
            cls._started = True

    @staticmethod
    def _run() -> None:
        while True:
            if libvirt.virEventRunDefaultImpl() < 0:  # pragma: no cover - libvirt internal failure
                _LOG.error(event("events.loop_failed"))


@dataclass
class Pending:
    """What happened since the last ``poll``."""

    stopped: bool = False
    metadata_changed: bool = False
    devices_changed: bool = False
    disconnected: bool = False


class DomainEvents:
    """Subscribes to one domain's events on ``conn``; ``poll()`` returns and clears them."""

    def __init__(self, conn: Any, dom: Any, wake: threading.Event) -> None:
        """Raises DomainError when libvirt refuses a subscription."""
        self._conn = conn
        self._wake = wake
        self._lock = threading.Lock()
        self._pending = Pending()
        self._ids: list[int] = []
        subscriptions = (
            (libvirt.VIR_DOMAIN_EVENT_ID_LIFECYCLE, self._on_lifecycle),
            (libvirt.VIR_DOMAIN_EVENT_ID_METADATA_CHANGE, self._on_metadata),
            (libvirt.VIR_DOMAIN_EVENT_ID_DEVICE_ADDED, self._on_device),
            (libvirt.VIR_DOMAIN_EVENT_ID_DEVICE_REMOVED, self._on_device),
            (libvirt.VIR_DOMAIN_EVENT_ID_BLOCK_JOB_2, self._on_block_job),
        )
        try:
            for event_id, callback in subscriptions:
                self._ids.append(conn.domainEventRegisterAny(dom, event_id, callback, None))
            conn.registerCloseCallback(self._on_close, None)
        except libvirt.libvirtError as err:
            self.close()
            raise DomainError(f"cannot subscribe to domain events: {err.get_error_message()}") from err

    def _set(self, **flags: bool) -> None:
        with self._lock:
            for name, value in flags.items():
                setattr(self._pending, name, getattr(self._pending, name) or value)
        self._wake.set()

    def _on_lifecycle(self, _conn: Any, _dom: Any, kind: int, detail: int, _opaque: Any) -> None:
        if kind in (Lifecycle.STOPPED, Lifecycle.UNDEFINED):
            _LOG.info(event("events.stopped", kind=kind, detail=detail))
            self._set(stopped=True)
        elif kind == Lifecycle.RESUMED:  # an agent waiting for an incoming migration to end goes on at once
            self._wake.set()

    def _on_metadata(self, _conn: Any, _dom: Any, _mtype: int, nsuri: str | None, _opaque: Any) -> None:
        if nsuri == HOTSET_NAMESPACE:
            return  # the agent's own saves of the hot set: nothing the agent must re-read
        self._set(metadata_changed=True)

    def _on_device(self, _conn: Any, _dom: Any, dev_alias: str, _opaque: Any) -> None:
        _LOG.info(event("events.device", alias=dev_alias))
        self._set(devices_changed=True)

    def _on_block_job(self, _conn: Any, _dom: Any, disk: str, job: int, status: int, _opaque: Any) -> None:
        # A commit, pull or copy that ends (pivot included) may have replaced the disk's image.
        if status in (libvirt.VIR_DOMAIN_BLOCK_JOB_COMPLETED, libvirt.VIR_DOMAIN_BLOCK_JOB_FAILED,
                      libvirt.VIR_DOMAIN_BLOCK_JOB_CANCELED):
            _LOG.info(event("events.block_job", disk=disk, job=job, status=status))
            self._set(devices_changed=True)

    def _on_close(self, _conn: Any, reason: int, _opaque: Any) -> None:
        _LOG.warning(event("events.disconnected", reason=reason))
        self._set(disconnected=True)

    def poll(self) -> Pending:
        """What happened since the previous call."""
        with self._lock:
            pending, self._pending = self._pending, Pending()
        return pending

    def close(self) -> None:
        """Unsubscribe (errors of a connection already gone are ignored)."""
        for callback_id in self._ids:
            try:
                self._conn.domainEventDeregisterAny(callback_id)
            except libvirt.libvirtError:
                pass
        self._ids = []
        try:
            self._conn.unregisterCloseCallback()
        except libvirt.libvirtError:
            pass
