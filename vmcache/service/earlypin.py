"""A test-only switch: lock a migration's carried hot set on the destination *before* QEMU activates it.

vmcache never does this. On a live migration's destination the agent
waits until the domain has come in (vmcache.service.incoming): at activation
QEMU drops its image's page cache (file-posix ``drop-cache``, fadvise
DONTNEED), which cannot drop a page a process maps, and on shared storage
the source went on writing after any page was read here - so a page
locked earlier survives the drop and serves the guest the source's old
bytes. This module does exactly that wrong thing, so that the stale-data
check of tests/host/test_migrate_hosts.py can be shown to catch it. It is
on only when the agent's environment says ``VMCACHE_TEST_PIN_BEFORE_ACTIVATION=1``
(a systemd drop-in the test writes on its destination host), and it logs
a warning line when it pins.
"""

from __future__ import annotations

import logging
import os

from ..host.locking import mlock
from ..host.pagecache import map_readonly, unmap
from ..logfmt import event
from ..settings.hotset import HotSet

__all__ = ["ENV", "EarlyPins"]

ENV = "VMCACHE_TEST_PIN_BEFORE_ACTIVATION"


class EarlyPins:
    """Every region of a hot set mapped and locked at once, without budget or check; :meth:`release`."""

    def __init__(self, logger: logging.Logger) -> None:
        self._log = logger
        self._maps: list[tuple[int, int]] = []

    def pin(self, hotset: HotSet | None) -> None:
        """Lock the set's regions of each disk's image (paths as saved). Raises OSError."""
        for disk in hotset.disks if hotset is not None else ():
            fd = os.open(disk.image, os.O_RDONLY | os.O_CLOEXEC)
            try:
                for region in disk.regions:
                    addr = map_readonly(fd, region.start, region.length)
                    self._maps.append((addr, region.length))
                    mlock(addr, region.length)
            finally:
                os.close(fd)
        self._log.warning(event("test.pinned_before_activation", regions=len(self._maps),
                                bytes=sum(n for _a, n in self._maps)))

    def release(self) -> None:
        """Unlock and unmap them (their pages stay cached as they are)."""
        for addr, length in self._maps:
            unmap(addr, length)
        self._maps = []
