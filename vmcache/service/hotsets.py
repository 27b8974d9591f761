"""The agent's side of warm start: load the saved hot set once, warm new disks, save it again.

:class:`HotSetKeeper` reads the domain's saved hot set when the agent
starts (a set that cannot be read is logged in one line and ignored: a
cold start), hands each disk the record saved for it when it matches the
image (vmcache.settings.hotset.mismatch), and writes the set of regions
every disk holds back into the domain's XML every ``hotset_interval``
and when the agent stops: the live definition while the domain runs, and
the persistent one of a persistent domain (so a stop/start and a host
reboot find it too). A disk still warming keeps the record it started
from, so an agent restarted in the middle of a warm start loses nothing;
a disk backing off (free-memory floor, memory pressure: it holds less than
it planned) keeps the record it had, so a host shutting down under
pressure does not save a shrunken set.

Saving never fails the agent: libvirt errors are logged and retried at
the next save. Nothing is saved once vmcache is disabled or its element
removed (``vmcache disable --remove`` removes the saved set too).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from ..errors import DomainGoneError, VmcacheError
from ..host.cachestat import fd_size
from ..host.imageid import image_id
from ..host.virtdomain import Affect
from ..logfmt import event
from ..model.warm import WarmStart
from ..settings.hotset import DiskHotSet, HotSet, mismatch
from ..settings.metadata import DomainSettings
from .engine import DiskEngine

__all__ = ["HotSetKeeper", "HotSetDomain", "ManagedDisk"]


class HotSetDomain(Protocol):
    """What the keeper needs of a domain (vmcache.host.virtdomain.VirtDomain)."""

    def hotset(self, affect: Affect = Affect.CURRENT) -> HotSet | None: ...
    def set_hotset(self, hotset: HotSet | None, affect: Affect = Affect.CURRENT) -> None: ...
    def settings(self, affect: Affect = Affect.CURRENT) -> DomainSettings | None: ...
    def is_persistent(self) -> bool: ...


class ManagedDisk(Protocol):
    """What the keeper needs of a managed disk (vmcache.service.diskworker.DiskWorker)."""

    target: str
    image: str
    engine: DiskEngine


def _image_size(path: str) -> int:
    """Bytes of the image file or block device. Raises OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return fd_size(fd)
    finally:
        os.close(fd)


def _by_metadata(settings: DomainSettings | None) -> bool:
    return settings is not None and settings.enabled


class HotSetKeeper:
    """One agent's saved hot set: :meth:`load` once, :meth:`warm` each new disk, :meth:`save`."""

    def __init__(self, domain: Callable[[], HotSetDomain], *, every: float, logger: logging.Logger,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        """``domain``: the domain as libvirt has it now (a new object after a reconnect)."""
        self._dom = domain
        self.every = every
        self._log = logger
        self._clock = clock
        self._wall = wall
        self._loaded: dict[str, DiskHotSet] = {}
        self._warming: dict[str, DiskHotSet] = {}  # by target: the record a disk started from
        self._kept: dict[str, DiskHotSet] = {}     # by target: the record last saved (or started from)
        self._last_save: float | None = None
        self.saved_at: float | None = None
        """Wall time of the last successful save (status)."""

    def load(self) -> None:
        """Read the saved set; one warning line and a cold start if it is unusable.

        The live definition's, or where it has none, the persistent one's: a
        start right after a stop (``virsh destroy; virsh start``, a snapshot
        revert that restarts QEMU) copies the persistent definition into the
        new run before the stopping agent saves its set there. This agent
        starts only once that one has exited (the pidfile lock), so the
        persistent definition has the set by now.
        """
        try:
            dom = self._dom()
            hotset, where = dom.hotset(Affect.LIVE), "live"
            if hotset is None and dom.is_persistent():
                hotset, where = dom.hotset(Affect.CONFIG), "persistent"
        except VmcacheError as err:  # ConfigError among them: hostile or broken element
            self._log.warning(event("hotset.unusable", error=err, action="cold start"))
            return
        if hotset is None:
            self._log.info(event("hotset.none"))
            return
        self._loaded = {d.dev: d for d in hotset.disks}
        self._log.info(event("hotset.loaded", disks=len(hotset.disks), saved=hotset.saved, definition=where,
                             bytes=sum(d.bytes for d in hotset.disks)))

    def warm_all(self, disks: Iterable[ManagedDisk]) -> None:
        """Warm every disk that has a matching record; records left over are logged and dropped.

        Called once, after the agent's first look at the domain's disks: a
        disk added later, or a record saved for a disk no longer there
        (removed, renamed), starts cold.
        """
        for disk in disks:
            self.warm(disk)
        for dev, record in self._loaded.items():
            self._log.warning(event("hotset.ignored", disk=dev, image=record.image,
                                    reason=f"no managed disk {dev} now"))
        self._loaded = {}

    def warm(self, disk: ManagedDisk) -> None:
        """Give ``disk``'s engine the record saved for it, if it describes its image (once per record)."""
        record = self._loaded.pop(disk.target, None)
        if record is None:
            return
        engine = disk.engine
        try:
            size = _image_size(disk.image)
            current_id = image_id(disk.image)
        except (OSError, VmcacheError) as err:
            self._log.warning(event("hotset.ignored", disk=disk.target, reason=f"cannot read the image: {err}"))
            return
        reason = mismatch(record, dev=disk.target, image=disk.image, size=size, image_id=current_id)
        if reason is not None:
            self._log.warning(event("hotset.ignored", disk=disk.target, reason=reason))
            return
        engine.warm = WarmStart(((r, record.mean_heat(r)) for r in record.regions), engine.params)
        self._warming[disk.target] = record
        self._kept[disk.target] = record
        self._log.info(event("hotset.warming", disk=disk.target, regions=len(record.regions), bytes=record.bytes))

    def due(self) -> bool:
        """Whether a periodic save is due (the first one: one interval after the start)."""
        if not self.every:
            return False
        now = self._clock()
        if self._last_save is None:
            self._last_save = now
        return now - self._last_save >= self.every

    def save(self, disks: Iterable[ManagedDisk], *, live: bool,
             managed: Callable[[DomainSettings | None], bool] = _by_metadata) -> bool:
        """Write the regions every disk holds: live definition if ``live``, persistent if the domain is.

        With nothing held the element is removed.
        Skipped (False) when vmcache no longer manages the domain: ``managed``
        of its metadata now (disabled, or its element removed and no host rule
        opts it in).
        Errors are logged, never raised; True when the set was written.
        """
        self._last_save = self._clock()
        dom = self._dom()
        try:
            persistent = dom.is_persistent()
            if not live and not persistent:
                return False  # a transient domain that stopped is gone, and its XML with it
            settings = dom.settings(Affect.LIVE if live else Affect.CONFIG)
        except DomainGoneError:
            self._log.info(event("hotset.not_saved", reason="the domain is gone (a transient domain that stopped)"))
            return False
        except VmcacheError as err:
            self._log.log(logging.WARNING if live else logging.INFO, event("hotset.save_failed", error=err))
            return False
        if not managed(settings):
            self._log.info(event("hotset.not_saved", reason="vmcache is disabled for the domain"))
            return False
        flags = (Affect.LIVE if live else Affect(0)) | (Affect.CONFIG if persistent else Affect(0))
        started = time.process_time()
        try:
            hotset = HotSet(saved=int(self._wall()), disks=tuple(self._records(disks)))
            # nothing held (the guest left every region): no element, the next start is a cold one
            dom.set_hotset(hotset if hotset.disks else None, flags)
        except VmcacheError as err:
            self._log.warning(event("hotset.save_failed", error=err))
            return False
        self.saved_at = self._wall()
        self._log.info(event("hotset.saved", disks=len(hotset.disks), bytes=sum(d.bytes for d in hotset.disks),
                             live=live, config=persistent, cpu_ms=f"{(time.process_time() - started) * 1e3:.2f}"))
        return True

    def _records(self, disks: Iterable[ManagedDisk]) -> Iterable[DiskHotSet]:
        for disk in disks:
            engine = disk.engine
            record = self._warming.get(disk.target)
            if engine.warm is not None and not engine.warm.done and record is not None:
                yield record  # still warming: what it started from, not a part of it
                continue
            kept = self._kept.get(disk.target)
            if kept is not None and kept.image == disk.image and engine.last is not None and engine.last.backing_off:
                yield kept  # floor or pressure cut what it holds: not a measure of what is hot
                continue
            regions = engine.hot_regions() if engine.residency is not None else []
            if not regions:
                continue  # nothing to warm: and an image gets an id only when it has a set
            try:
                size = _image_size(disk.image)
                ident = image_id(disk.image, create=True)
            except (OSError, VmcacheError) as err:
                self._log.warning(event("hotset.disk_not_saved", disk=disk.target, error=err))
                continue
            record = DiskHotSet(disk.target, disk.image, size, ident, engine.params.block_size, tuple(regions))
            self._kept[disk.target] = record
            yield record
