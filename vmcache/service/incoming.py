"""The agent on a live migration's destination: wait until the domain has come in.

Until then libvirt holds the domain's job (a QMP command waits for it and
fails after 30 s), and the source still runs the guest: pages read now may
change before the switch, and the destination QEMU's drop of its page cache
at the switch cannot drop pages an agent locked. So the agent sends QEMU
nothing and pins nothing before :func:`await_arrival` returns.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ..errors import VmcacheError
from ..host.virtdomain import Affect
from ..logfmt import event
from .domainlink import DomainLink
from .earlypin import EarlyPins

__all__ = ["await_arrival", "INCOMING_POLL_SECONDS"]

INCOMING_POLL_SECONDS = 1.0


def await_arrival(link: DomainLink, *, wake: threading.Event, stopping: Callable[[], bool],
                  clock: Callable[[], float], log: logging.Logger,
                  waiting: Callable[[], None], early_pins: EarlyPins | None = None) -> bool:
    """Return once the domain is no longer coming in; False if it went away or a stop came meanwhile.

    ``wake`` is set by the domain's resume event (and by a stop request), ``waiting`` is called once
    when there is something to wait for (the agent shows "migrating"); ``early_pins``: tests only
    (vmcache.service.earlypin), the carried set locked while waiting, None everywhere else.
    Raises DomainError.
    """
    if not link.incoming():
        return True
    started = clock()
    log.info(event("agent.migration_wait"))
    waiting()
    if early_pins is not None:
        try:
            early_pins.pin(link.virt().hotset(Affect.LIVE))
        except (OSError, VmcacheError) as err:
            log.warning(event("test.pin_before_activation_failed", error=err))
    try:
        while link.incoming():
            wake.wait(INCOMING_POLL_SECONDS)
            wake.clear()
            if stopping() or not link.alive():
                return False
    finally:
        if early_pins is not None:
            early_pins.release()
    log.info(event("agent.migration_done", waited=f"{clock() - started:.3f}s"))
    return True
