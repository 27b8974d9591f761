"""The agent's side of warm start: load the saved hot set once, warm new disks, save it again.

:class:`HotSetKeeper` reads the domain's saved hot set when the agent
starts (a set that cannot be read is logged in one line and ignored: a
cold start), hands each disk the record saved for it when it matches the
image (vmcache.settings.hotset.mismatch), and writes the set each disk
saves - the blocks the guest read most, up to its budget
(vmcache.model.saveset), not its pins - into the domain's XML every ``hotset_interval``
and when the agent stops: the live definition while the domain runs, and
the persistent one of a persistent domain (so a stop/start and a host
reboot find it too) - and into the host's copy (vmcache.host.hotstore,
keyed by the domain's uuid), which outlives a fleet manager's fresh
definition of the domain. Between those saves the live definition's set
follows the disks' sets cycle by cycle (:meth:`HotSetKeeper.follow`: written when
its regions changed), because the live XML is what a live migration, ``virsh
save`` and managedsave carry: the set that arrives is at most a cycle old,
not ``hotset_interval``. At start the newest valid set of the three
wins. A disk still warming keeps the record it started
from, so an agent restarted in the middle of a warm start loses nothing;
a disk backing off (free-memory floor, memory pressure: it holds less than
it planned) keeps the record it had, so a host shutting down under
pressure does not save a set shrunk with its budget.

Saving never fails the agent: libvirt errors are logged and retried at
the next save. Nothing is saved once vmcache no longer manages the domain
(``vmcache disable --remove`` removes the saved set, the host's copy too).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from ..errors import DomainGoneError, VmcacheError
from ..host.cachestat import fd_size
from ..host.hotstore import HotStore
from ..host.imageid import image_id
from ..host.virtdomain import Affect
from ..logfmt import event
from ..model.warm import WarmStart
from ..settings.hotset import DiskHotSet, HotSet, mismatch, newest
from ..settings.metadata import DomainSettings
from .engine import DiskEngine

__all__ = ["HotSetKeeper", "HotSetDomain", "ManagedDisk"]


class HotSetDomain(Protocol):
    """What the keeper needs of a domain (vmcache.host.virtdomain.VirtDomain)."""

    def hotset(self, affect: Affect = Affect.CURRENT) -> HotSet | None: ...
    def set_hotset(self, hotset: HotSet | None, affect: Affect = Affect.CURRENT) -> None: ...
    def settings(self, affect: Affect = Affect.CURRENT) -> DomainSettings | None: ...
    def is_persistent(self) -> bool: ...
    def job(self) -> str | None: ...


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
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 store: HotStore | None = None, uuid: Callable[[], str] = lambda: "") -> None:
        """``domain``: the domain as libvirt has it now (a new object after a reconnect); ``store``: the
        host's copies (None: the XML only), by the domain's ``uuid`` (known once the agent attached)."""
        self._dom = domain
        self.every = every
        self._log = logger
        self._clock = clock
        self._wall = wall
        self._store = store
        self._uuid = uuid
        self._loaded: dict[str, DiskHotSet] = {}
        self._warming: dict[str, DiskHotSet] = {}  # by target: the record a disk started from
        self._kept: dict[str, DiskHotSet] = {}     # by target: the record last saved (or started from)
        self._last_save: float | None = None
        self._live: tuple[tuple[str, str, tuple[tuple[int, int], ...]], ...] | None = None  # regions last written live
        self.saved_at: float | None = None
        """Wall time of the last successful save (status)."""
        self.source: str | None = None
        """Where the set warmed from came from: live, persistent (the definitions' XML) or host (status)."""

    def _sources(self) -> Iterator[tuple[str, Callable[[], HotSet | None]]]:
        """Where a saved set may be, in the order a tie goes (the XML, which rides a migration, first)."""
        dom = self._dom()
        yield "live", lambda: dom.hotset(Affect.LIVE)
        if dom.is_persistent():
            yield "persistent", lambda: dom.hotset(Affect.CONFIG)
        if self._store is not None:
            store, uuid = self._store, self._uuid()
            yield "host", lambda: store.load(uuid)

    def load(self) -> None:
        """Read the saved sets and keep the newest valid one; one warning line and a cold start if none is.

        The live definition's, the persistent one's and the host's copy: a
        start right after a stop (``virsh destroy; virsh start``, a snapshot
        revert that restarts QEMU) copies the persistent definition into the
        new run before the stopping agent saves its set there (this agent
        starts only once that one has exited, the pidfile lock), and a
        fleet manager that defined the domain afresh left only the host's.
        """
        found: list[tuple[str, HotSet]] = []
        errors: list[str] = []
        try:
            for where, read in self._sources():
                try:
                    hotset = read()
                except VmcacheError as err:  # ConfigError among them: hostile or broken element
                    errors.append(f"{where}: {err}")
                    continue
                if hotset is not None:
                    found.append((where, hotset))
        except VmcacheError as err:  # the domain itself (is_persistent)
            errors.append(str(err))
        chosen = newest(found)
        if chosen is None:
            if errors:
                self._log.warning(event("hotset.unusable", error=errors[0], others=len(errors) - 1,
                                        action="cold start"))
            else:
                self._log.info(event("hotset.none"))
            return
        where, hotset = chosen
        for error in errors:
            self._log.warning(event("hotset.unusable", error=error, action=f"the {where} set is used"))
        self._loaded = {d.dev: d for d in hotset.disks}
        self.source = where
        others = ",".join(f"{w}:{h.saved}" for w, h in found if w != where)
        self._log.info(event("hotset.loaded", disks=len(hotset.disks), saved=hotset.saved, definition=where,
                             bytes=sum(d.bytes for d in hotset.disks), others=others or "none"))

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
        engine.warm = WarmStart(((r, record.mean_heat(r)) for r in record.regions), engine.params, record.order())
        self._warming[disk.target] = record
        self._kept[disk.target] = record
        self._log.info(event("hotset.warming", disk=disk.target, regions=len(record.regions), bytes=record.bytes))

    def follow(self, disks: Iterable[ManagedDisk], *,
               managed: Callable[[DomainSettings | None], bool] = _by_metadata) -> None:
        """After a cycle: the full save when it is due (:meth:`save`), else the live definition's set
        rewritten if its regions changed since it was last written (one libvirt call; nothing when they
        did not). The live set is what a migration carries: the blocks the guest reads now first
        (vmcache.model.saveset). Never raises."""
        if self.due():
            self.save(disks, live=True, managed=managed)
            return
        if not self.every:
            return
        try:
            hotset = HotSet(saved=int(self._wall()), disks=tuple(self._records(disks, recent=True)))
        except VmcacheError as err:
            self._log.warning(event("hotset.save_failed", error=err))
            return
        if _spans(hotset) == self._live:
            return
        dom = self._dom()
        try:
            if dom.job() is not None or not managed(dom.settings(Affect.LIVE)):  # a job: written next cycle
                return
            dom.set_hotset(hotset if hotset.disks else None, Affect.LIVE)
        except VmcacheError as err:
            self._log.info(event("hotset.live_save_failed", error=err))
            return
        self._live = _spans(hotset)
        self.saved_at = self._wall()
        self._log.debug(event("hotset.saved", disks=len(hotset.disks), bytes=sum(d.bytes for d in hotset.disks),
                              live=True, config=False, to="live"))

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
        """Write the set every disk saves: into the live definition if ``live``, the persistent one if
        the domain is, and the host's copy.

        With nothing held the element (and the host's copy) is removed.
        Skipped (False) when vmcache no longer manages the domain: ``managed``
        of its metadata now (disabled, or its element removed and no host rule
        opts it in). A domain already gone (a transient one that stopped)
        keeps only the host's copy. Errors are logged, never raised; True
        when the set was written somewhere.
        """
        self._last_save = self._clock()
        dom = self._dom()
        flags: Affect | None = None
        try:
            flags = self._xml_flags(dom, live, managed)
        except _Unmanaged:
            self._log.info(event("hotset.not_saved", reason="vmcache no longer manages the domain"))
            return False
        except DomainGoneError:
            self._log.info(event("hotset.not_in_xml", reason="the domain is gone (a transient domain that stopped)"))
        except VmcacheError as err:
            self._log.log(logging.WARNING if live else logging.INFO, event("hotset.save_failed", error=err))
        started = time.process_time()
        try:
            hotset = HotSet(saved=int(self._wall()), disks=tuple(self._records(disks)))
        except VmcacheError as err:
            self._log.warning(event("hotset.save_failed", error=err))
            return False
        wrote = []
        if flags is not None:
            try:  # nothing held (the guest left every region): no element, the next start is a cold one
                self._write_xml(dom, hotset, disks, flags)
                wrote.append("xml")
            except VmcacheError as err:
                self._log.warning(event("hotset.save_failed", error=err))
        if self._store is not None and self._save_host(hotset):
            wrote.append("host")
        if not wrote:
            return False
        self.saved_at = self._wall()
        self._log.info(event("hotset.saved", disks=len(hotset.disks), bytes=sum(d.bytes for d in hotset.disks),
                             live=live, config=bool(flags and flags & Affect.CONFIG), to="+".join(wrote),
                             cpu_ms=f"{(time.process_time() - started) * 1e3:.2f}"))
        return True

    def _write_xml(self, dom: HotSetDomain, hotset: HotSet, disks: Iterable[ManagedDisk], flags: Affect) -> None:
        """``hotset`` into the persistent definition; the live one gets what :meth:`follow` writes there (what
        a migration carries), so that a save does not swap it for a cycle. Raises VmcacheError."""
        if flags & Affect.LIVE:
            live = HotSet(saved=hotset.saved, disks=tuple(self._records(disks, recent=True)))
            dom.set_hotset(live if live.disks else None, Affect.LIVE)
            self._live = _spans(live)
        if flags & Affect.CONFIG:
            dom.set_hotset(hotset if hotset.disks else None, Affect.CONFIG)

    def _xml_flags(self, dom: HotSetDomain, live: bool,
                   managed: Callable[[DomainSettings | None], bool]) -> Affect | None:
        """The definitions a save writes into now, None for none (the host's copy only).

        A stopped domain's set goes to the host's copy alone where there is
        one (the newest wins at the next start): the persistent XML would
        need the domain's job, which whatever stopped it may still hold (a
        snapshot revert). A running domain busy with a job (a migration, a
        save) is written next time: a metadata change would wait for the
        job, 30 s a try. Raises _Unmanaged, VmcacheError.
        """
        persistent = dom.is_persistent()
        if not (live or persistent):
            return None
        if not managed(dom.settings(Affect.LIVE if live else Affect.CONFIG)):
            raise _Unmanaged
        if not live and self._store is not None:
            return None
        if live and (job := dom.job()) is not None:
            self._log.info(event("hotset.xml_later", reason=f"libvirt is busy with a job of the domain ({job})"))
            return None
        return (Affect.LIVE if live else Affect(0)) | (Affect.CONFIG if persistent else Affect(0))

    def _save_host(self, hotset: HotSet) -> bool:
        assert self._store is not None
        try:
            if not hotset.disks:
                self._store.remove(self._uuid())
                return True
            pruned = self._store.save(self._uuid(), hotset)
        except VmcacheError as err:
            self._log.warning(event("hotset.host_save_failed", error=err))
            return False
        if pruned:
            self._log.info(event("hotset.pruned", files=len(pruned)))
        return True

    def _records(self, disks: Iterable[ManagedDisk], *, recent: bool = False) -> Iterable[DiskHotSet]:
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
            regions = engine.hot_regions(recent=recent) if engine.residency is not None else []
            if not regions:
                continue  # nothing to warm: and an image gets an id only when it has a set
            try:
                size = _image_size(disk.image)
                ident = image_id(disk.image, create=True)
            except (OSError, VmcacheError) as err:
                self._log.warning(event("hotset.disk_not_saved", disk=disk.target, error=err))
                continue
            record = DiskHotSet(disk.target, disk.image, size, ident, engine.params.block_size, tuple(regions),
                                engine.first_reads(regions))
            self._kept[disk.target] = record
            yield record


def _spans(hotset: HotSet) -> tuple[tuple[str, str, tuple[tuple[int, int], ...]], ...]:
    """What a live save changes: each disk's image and the byte ranges of its regions (not their heat,
    which moves every cycle)."""
    return tuple((d.dev, d.image, tuple((r.start, r.length) for r in d.regions)) for d in hotset.disks)


class _Unmanaged(Exception):
    """vmcache no longer manages the domain: nothing is saved."""
