"""The read-only backing layers under an agent's disks (qcow2 overlays over a base image).

Guest reads of data the overlay never got go to its backing files: those
are page-cached files like the top, scanned and pinned the same way, by a
:class:`~vmcache.service.diskworker.DiskWorker` without a tracker (QEMU
writes only the top). A base shared by several domains is one file and one
page cache, so exactly one agent manages it: the holder of its
:class:`~vmcache.host.layerlock.LayerLock`. The others list it as "managed
by domain X" and try the lock again every cycle, so one of them takes the
file over within a cycle of the holder's exit.

The layers of a disk share its budget with the top (the disk set divides
it between them by benefit, like the domain's grant between its disks).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace

from ..errors import VmcacheError
from ..host.layerlock import LayerLock, holder, lock_key, sweep
from ..logfmt import event
from ..observe.status import DiskStatus
from ..settings.policy import DiskChoice
from .diskworker import DiskWorker

__all__ = ["Layers", "LayerFactory", "Wanted"]

#: Builds the worker of one layer: (its choice: the top's, with the layer's file as source; the top's target).
LayerFactory = Callable[[DiskChoice, str], DiskWorker]


@dataclass(frozen=True)
class Wanted:
    """A file of a disk's backing chain, which ``target``'s ``choice`` (its top's) reads through."""

    path: str
    target: str
    choice: DiskChoice


@dataclass
class _Held:
    worker: DiskWorker
    lock: LayerLock


class Layers:
    """The backing layers one agent manages, holds back from (another agent's), or just left as a top."""

    def __init__(self, domain: str, lock_dir: str, *, logger: logging.Logger,
                 take: Callable[[str, str, str], LayerLock | None] = LayerLock.take) -> None:
        self._domain = domain
        self._dir = lock_dir
        self._log = logger
        self._take = take
        self._held: dict[str, _Held] = {}          # by lock key: the layers this agent manages
        self._waiting: dict[str, Wanted] = {}      # by lock key: held by another agent
        self._parked: dict[str, DiskWorker] = {}   # by lock key: old tops, heat and pins kept for the next sync
        self._make: LayerFactory | None = None

    def park(self, worker: DiskWorker, *, qemu_alive: bool) -> None:
        """Keep a replaced top's heat and pins until :meth:`sync` says whether it is a layer now."""
        try:
            key = lock_key(worker.image)
        except VmcacheError:
            worker.close(qemu_alive=qemu_alive)
            return
        worker.demote(qemu_alive=qemu_alive)
        self._parked[key] = worker

    def sync(self, wanted: Iterable[Wanted], make: LayerFactory, *, qemu_alive: bool) -> None:
        """Manage exactly the ``wanted`` layers this agent can lock; drop the rest."""
        self._make = make
        want: dict[str, Wanted] = {}
        for item in wanted:
            try:
                want.setdefault(lock_key(item.path), item)
            except VmcacheError as err:
                self._log.warning(event("layer.unusable", disk=item.target, image=item.path, error=err))
        for key in [k for k in self._held if k not in want]:
            self._release(key, qemu_alive=qemu_alive)
        self._waiting = {k: w for k, w in self._waiting.items() if k in want}
        for key, item in want.items():
            if key in self._held:
                self._held[key].worker.budget = item.choice.budget
            else:
                self._acquire(key, item, qemu_alive=qemu_alive)
        for key in list(self._parked):  # old tops that are no layer of anything now
            self._parked.pop(key).close(qemu_alive=qemu_alive)

    def retry(self) -> None:
        """Try the locks other agents held again: take over a layer whose holder went."""
        for key, item in list(self._waiting.items()):
            if self._acquire(key, item, qemu_alive=True):
                self._log.info(event("layer.taken_over", disk=item.target, image=item.path))

    def _acquire(self, key: str, item: Wanted, *, qemu_alive: bool) -> bool:
        try:
            lock = self._take(self._dir, key, self._domain)
        except OSError as err:
            self._log.warning(event("layer.lock_failed", image=item.path, error=err))
            lock = None
        parked = self._parked.pop(key, None)
        if lock is None:
            if parked is not None:
                parked.close(qemu_alive=qemu_alive)
            self._waiting[key] = item
            return False
        self._waiting.pop(key, None)
        try:
            worker = parked if parked is not None else self._new(item)
        except VmcacheError as err:
            lock.release()
            self._log.warning(event("layer.start_failed", disk=item.target, image=item.path, error=err))
            return False
        worker.budget = item.choice.budget
        self._held[key] = _Held(worker, lock)
        self._log.info(event("layer.managed", disk=item.target, image=item.path, kept=parked is not None))
        return True

    def _new(self, item: Wanted) -> DiskWorker:
        assert self._make is not None
        disk = replace(item.choice.disk, source=item.path, alias=None)
        return self._make(replace(item.choice, disk=disk), item.target)

    def _release(self, key: str, *, qemu_alive: bool) -> None:
        held = self._held.pop(key)
        try:
            held.worker.close(qemu_alive=qemu_alive)
        finally:
            held.lock.release()  # after the unpin: the next holder never pins beside it
        self._log.info(event("layer.dropped", disk=held.worker.target, image=held.worker.image))

    def workers(self, target: str | None = None) -> list[DiskWorker]:
        """The layers managed here (under ``target``'s top only, when given)."""
        return [h.worker for h in self._held.values() if target is None or h.worker.target == target]

    def held(self, path: str) -> DiskWorker | None:
        """The layer worker of the file at ``path`` when this agent manages it as a layer."""
        try:
            held = self._held.get(lock_key(path))
        except VmcacheError:
            return None
        return held.worker if held is not None else None

    def paths(self) -> Mapping[str, str]:
        """Every layer file this agent manages or waits for, by real path: the target whose chain has it."""
        items = [(h.worker.image, h.worker.target) for h in self._held.values()]
        items += [(w.path, w.target) for w in self._waiting.values()]
        return {os.path.realpath(path): target for path, target in items}

    def pinned_bytes(self) -> int:
        return sum(h.worker.pinned_bytes for h in self._held.values())

    def statuses(self) -> list[DiskStatus]:
        """The managed layers, then the ones another agent manages (with whose they are)."""
        waiting = [DiskStatus(target=w.target, source=w.path, cache=w.choice.disk.cache_mode, eligible=False,
                              reason=f"managed by domain {holder(self._dir, key) or 'another agent'}",
                              layer_of=w.target) for key, w in self._waiting.items()]
        return [h.worker.status for h in self._held.values()] + waiting

    def close_all(self, *, qemu_alive: bool) -> None:
        """Unpin and release every layer (shutdown); one failing close does not stop the others."""
        for key in list(self._held):
            try:
                self._release(key, qemu_alive=qemu_alive)
            except Exception as err:  # noqa: BLE001 - keep cleaning up the rest
                self._log.error(event("layer.close_failed", error=err))
        for worker in self._parked.values():
            worker.close(qemu_alive=qemu_alive)
        self._parked.clear()
        self._waiting.clear()
        swept = sweep(self._dir)  # files of holders killed before they could remove theirs
        if swept:
            self._log.info(event("layer.locks_swept", count=swept))
