"""The set of disks one agent manages: which ones, their workers, their cycles.

:meth:`DiskSet.sync` makes the workers match the domain's eligible disks
(at start, on hotplug/unplug, on a metadata change, when a disk's cycle
starts failing); :meth:`DiskSet.cycle` runs every worker once under the
bytes the agent's :class:`~vmcache.service.budget.Budget` granted. The
workers are built by a factory (the composition root's), so a test drives
the set with fakes.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from ..errors import VmcacheError
from ..host.blockdev import ImageDisk, device_images, discover_disks
from ..host.pagerefs import PageRefs
from ..host.qmp import Monitor
from ..logfmt import event
from ..model.params import ModelParams
from ..model.share import Curve
from ..observe.heatmap.data import HeatmapData
from ..observe.status import DiskStatus
from ..settings.config import HostConfig
from ..settings.metadata import DomainInfo
from ..settings.policy import DiskChoice, choose_disks
from .diskworker import DiskWorker

__all__ = ["DiskSet", "SetCycle", "WorkerFactory"]

#: Builds the worker of one disk: (choice, its storage node or None, monitor, model parameters) -> worker.
WorkerFactory = Callable[[DiskChoice, "str | None", Monitor, ModelParams], DiskWorker]


@dataclass(frozen=True)
class SetCycle:
    """What one cycle of every disk showed the agent."""

    backing_off: bool
    resync: bool  # a disk started failing: its image may have been replaced (pivot, media change: no event)
    error: str | None


class DiskSet:
    """The workers of one domain's managed disks, and the disks it leaves alone (with why)."""

    def __init__(self, config: HostConfig, make_worker: WorkerFactory, *, refs: PageRefs, logger: logging.Logger,
                 discover: Callable[[Monitor], list[ImageDisk]] = discover_disks,
                 images: Callable[[Monitor], set[str]] = device_images) -> None:
        """``refs``: the referenced bits of pinned pages, shared by the workers and cleared after each cycle;
        ``discover`` finds QEMU's image nodes, ``images`` the files its devices use now."""
        self._config = config
        self._make_worker = make_worker
        self._refs = refs
        self._discover = discover
        self._images = images
        self._log = logger
        self._workers: dict[str, DiskWorker] = {}
        self._skipped: list[DiskStatus] = []
        self._lock = threading.Lock()  # the agent's cycles vs heat maps served over HTTP

    def sync(self, info: DomainInfo, monitor: Callable[[], Monitor], *, qemu_alive: Callable[[], bool]) -> None:
        """Start, keep or drop workers so they match ``info``'s eligible disks.

        Raises ConfigError when the metadata's model parameters are not acceptable.
        """
        settings = info.settings
        if settings is None:
            return
        params = self._config.model_params(settings.model)
        choices = _once_per_file(choose_disks(info.disks, settings, self._config))
        wanted = {c.disk.target: c for c in choices if c.eligible}
        for target in [t for t, w in self._workers.items() if t not in wanted or w.image != wanted[t].disk.source]:
            self.drop(target, qemu_alive=qemu_alive())
        self._skipped = [DiskStatus(target=c.disk.target, source=c.disk.source, cache=c.disk.cache_mode,
                                    eligible=False, reason=c.reason) for c in choices if not c.eligible]
        for skipped in self._skipped:
            self._log.info(event("disk.skipped", disk=skipped.target, reason=skipped.reason))
        for target, choice in wanted.items():
            if target in self._workers:
                self._workers[target].budget = choice.budget
        new = [c for t, c in wanted.items() if t not in self._workers]
        if new:
            self._start(new, monitor(), params)

    def _start(self, choices: list[DiskChoice], monitor: Monitor, params: ModelParams) -> None:
        try:
            found = self._discover(monitor)
        except VmcacheError as err:
            self._log.warning(event("disk.discovery_failed", error=err))
            found = []
        by_device = {d.device_id: d for d in found if d.device_id}
        by_file = {d.filename: d for d in found}
        for choice in choices:
            # By device first: two disks on one file are two node pairs with the same file name.
            target = choice.disk.target
            node = by_device.get(choice.disk.alias or "") or by_file.get(choice.disk.source or "")
            if node is not None and node.direct:
                self._skipped.append(DiskStatus(target=target, source=choice.disk.source,
                                                cache=choice.disk.cache_mode, eligible=False,
                                                reason="QEMU opened it with O_DIRECT"))
                continue
            try:
                worker = self._make_worker(choice, node.storage_node if node else None, monitor, params)
            except VmcacheError as err:
                self._log.warning(event("disk.start_failed", disk=target, error=err))
                continue
            with self._lock:
                self._workers[target] = worker
            self._log.info(event("disk.managed", disk=target, image=choice.disk.source, budget=choice.budget,
                                 node=node.storage_node if node else None))

    def replaced(self, monitor: Monitor) -> list[str]:
        """Managed disks whose image no device uses any more (snapshot, pivot, media change): resync them.

        A failed query counts as no change (the next cycle asks again).
        """
        if not self._workers:
            return []
        try:
            images = self._images(monitor)
        except VmcacheError as err:
            self._log.debug(event("disk.images_unknown", error=err))
            return []
        replaced = [t for t, w in self._workers.items() if os.path.realpath(w.image) not in images]
        for target in replaced:
            self._log.info(event("disk.image_changed", disk=target, image=self._workers[target].image))
        return replaced

    def workers(self) -> list[DiskWorker]:
        """The workers of the managed disks (the saved hot set reads their engines)."""
        return list(self._workers.values())

    def budgets(self) -> dict[str, int]:
        """Each managed disk's own budget, by target."""
        return {target: w.budget for target, w in self._workers.items()}

    def cycle(self, budgets: Mapping[str, int], *, title: str) -> SetCycle:
        """One cycle of every disk under its granted bytes; heat-map files written after."""
        backing_off = resync = False
        for target, worker in list(self._workers.items()):
            was_failing = worker.failing
            with self._lock:
                stats = worker.cycle(budgets.get(target, 0))
            resync |= worker.failing and not was_failing
            if stats is None:
                continue
            backing_off |= stats.backing_off
            worker.write_heatmap(title)
        self._refs.clear()  # once for all disks: each engine read its pages' bits since the last clear
        error = next((w.status.error for w in self._workers.values() if w.status.error), None)
        return SetCycle(backing_off=backing_off, resync=resync, error=error)

    def demands(self, share: float) -> dict[str, Curve]:
        """Each disk's demand curve after its last cycle, at its budget times ``share``."""
        with self._lock:
            return {target: w.demand(share) for target, w in self._workers.items()}

    def pinned_bytes(self) -> int:
        """Bytes the disks hold pinned after their last cycle."""
        return sum(w.pinned_bytes for w in self._workers.values())

    def rebind(self, monitor: Monitor) -> None:
        """Give every worker a new monitor (libvirtd reconnected)."""
        for worker in self._workers.values():
            worker.rebind(monitor)

    def statuses(self) -> list[DiskStatus]:
        """Every disk's status: managed ones, then the ones left alone."""
        return [w.status for w in self._workers.values()] + self._skipped

    def heatmap_data(self, disk: str, *, title: str) -> HeatmapData | None:
        """A managed disk's heat map as of its last cycle; None for an unknown or not yet scanned disk."""
        with self._lock:
            worker = self._workers.get(disk)
            return worker.heatmap_data(title) if worker is not None else None

    def drop(self, target: str, *, qemu_alive: bool) -> None:
        """Stop managing ``target``: unpin, and remove its bitmaps and exports while QEMU is there."""
        with self._lock:
            worker = self._workers.pop(target)
        worker.close(qemu_alive=qemu_alive)
        self._log.info(event("disk.dropped", disk=target))

    def drop_all(self, *, qemu_alive: bool) -> None:
        """Drop every disk (model change, shutdown); one failing close does not stop the others."""
        for target in list(self._workers):
            try:
                self.drop(target, qemu_alive=qemu_alive)
            except Exception as err:  # noqa: BLE001 - keep cleaning up the rest
                self._log.error(event("disk.close_failed", disk=target, error=err))


def _once_per_file(choices: list[DiskChoice]) -> list[DiskChoice]:
    """The choices with every eligible disk on an image an earlier eligible disk uses skipped (managed once)."""
    first: dict[str, str] = {}
    out = []
    for choice in choices:
        if choice.eligible and choice.disk.source:
            image = os.path.realpath(choice.disk.source)
            if image in first:
                choice = replace(choice, eligible=False, budget=0,
                                 reason=f"same image as {first[image]}: managed once there")
            else:
                first[image] = choice.disk.target
        out.append(choice)
    return out
