"""DomainEvents: what libvirt's callbacks turn into for the agent's loop."""

from __future__ import annotations

import threading
from typing import Any

import libvirt

from vmcache.host.virtevents import DomainEvents
from vmcache.settings.hotset import HOTSET_NAMESPACE
from vmcache.settings.metadata import NAMESPACE


class FakeConn:
    def __init__(self) -> None:
        self.callbacks: dict[int, Any] = {}

    def domainEventRegisterAny(self, dom: Any, event_id: int, callback: Any, opaque: Any) -> int:
        self.callbacks[event_id] = callback
        return event_id

    def registerCloseCallback(self, callback: Any, opaque: Any) -> None:
        pass


def test_the_agents_own_hot_set_saves_are_not_metadata_changes() -> None:
    conn, wake = FakeConn(), threading.Event()
    events = DomainEvents(conn, object(), wake)
    on_metadata = conn.callbacks[libvirt.VIR_DOMAIN_EVENT_ID_METADATA_CHANGE]
    on_metadata(conn, None, libvirt.VIR_DOMAIN_METADATA_ELEMENT, HOTSET_NAMESPACE, None)
    assert not events.poll().metadata_changed and not wake.is_set()
    on_metadata(conn, None, libvirt.VIR_DOMAIN_METADATA_ELEMENT, NAMESPACE, None)  # the operator's settings
    assert events.poll().metadata_changed and wake.is_set()
    on_metadata(conn, None, libvirt.VIR_DOMAIN_METADATA_DESCRIPTION, None, None)
    assert events.poll().metadata_changed
