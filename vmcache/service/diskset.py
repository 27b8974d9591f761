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
from ..host.blockdev import ImageDisk, chain_layers, device_chains, device_images, discover_disks
from ..host.pagerefs import PageRefs
from ..host.qmp import Monitor
from ..logfmt import event
from ..model.params import ModelParams
from ..model.budget import divide_disks, domain_curve
from ..model.share import Curve
from ..observe.heatmap.data import HeatmapData
from ..observe.status import DiskStatus
from ..settings.config import HostConfig
from ..settings.metadata import DomainInfo
from ..settings.policy import DiskChoice, choose_disks, total_budget
from .diskworker import DiskWorker
from .layers import Layers, Wanted

__all__ = ["DiskSet", "SetCycle", "WorkerFactory"]

#: Builds the worker of one disk: (choice, its storage node or None, monitor, model parameters, and for a
#: read-only backing layer the target whose top it is under) -> worker.
WorkerFactory = Callable[[DiskChoice, "str | None", Monitor, ModelParams, "str | None"], DiskWorker]


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
                 images: Callable[[Monitor], set[str]] = device_images,
                 chains: Callable[[Monitor], dict[str, tuple[str, ...]]] = device_chains,
                 layers: Layers | None = None) -> None:
        """``refs``: the referenced bits of pinned pages, shared by the workers and cleared after each cycle;
        ``discover`` finds QEMU's image nodes, ``images`` the files its devices use now, ``chains`` their
        backing files; ``layers`` manages those (default: locks under the runtime dir)."""
        self._config = config
        self._make_worker = make_worker
        self._refs = refs
        self._discover = discover
        self._images = images
        self._chains = chains
        self._layers = layers or Layers("", os.path.join(config.runtime_dir, "layers"), logger=logger)
        self._curves: dict[str, dict[str, Curve]] = {}  # each disk's top and layers' curves, by target
        self._log = logger
        self._workers: dict[str, DiskWorker] = {}
        self._chosen: dict[str, DiskChoice] = {}  # the eligible disks' choices of the last sync, by target
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
            if target in wanted:  # a new top over it (snapshot) or a pivot: kept if it is a layer now
                with self._lock:
                    self._layers.park(self._workers.pop(target), qemu_alive=qemu_alive())
            else:
                self.drop(target, qemu_alive=qemu_alive())
        self._skipped = [DiskStatus(target=c.disk.target, source=c.disk.source, cache=c.disk.cache_mode,
                                    eligible=False, reason=c.reason) for c in choices if not c.eligible]
        for skipped in self._skipped:
            self._log.info(event("disk.skipped", disk=skipped.target, reason=skipped.reason))
        self._chosen = wanted
        for target, choice in wanted.items():
            if target in self._workers:
                self._workers[target].budget = choice.budget
        new = [c for t, c in wanted.items() if t not in self._workers]
        if not new and not self._workers:
            self._layers.close_all(qemu_alive=qemu_alive())
            return
        qmp = monitor()
        try:
            found: list[ImageDisk] | None = self._discover(qmp)
        except VmcacheError as err:
            self._log.warning(event("disk.discovery_failed", error=err))
            found = None
        self._start(new, found or [], qmp, params)
        if found is not None:  # the chains are unknown: the layers stay as they are until the next sync
            self._sync_layers(found, wanted, qmp, params, qemu_alive=qemu_alive())

    def _start(self, choices: list[DiskChoice], found: list[ImageDisk], monitor: Monitor,
               params: ModelParams) -> None:
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
                worker = self._make_worker(choice, node.storage_node if node else None, monitor, params, None)
            except VmcacheError as err:
                self._log.warning(event("disk.start_failed", disk=target, error=err))
                continue
            layer = self._layers.held(worker.image)
            with self._lock:
                if layer is not None:  # the pivot of a commit onto a layer: its heat and pins go on
                    worker.take_over(layer)
                self._workers[target] = worker
            self._log.info(event("disk.managed", disk=target, image=choice.disk.source, budget=choice.budget,
                                 node=node.storage_node if node else None))

    def _sync_layers(self, found: list[ImageDisk], choices: Mapping[str, DiskChoice], monitor: Monitor,
                     params: ModelParams, *, qemu_alive: bool) -> None:
        """Manage the backing files of every managed top that go through the page cache."""
        tops = {os.path.realpath(d.filename): d for d in found if d.qdev}
        wanted = []
        self._skipped = [s for s in self._skipped if s.layer_of is None]
        for target, worker in self._workers.items():
            top = tops.get(os.path.realpath(worker.image))
            for layer in chain_layers(found, top) if top else []:
                if layer.direct:
                    self._skipped.append(DiskStatus(target=target, source=layer.filename, cache="none",
                                                    eligible=False, reason="QEMU opened it with O_DIRECT",
                                                    layer_of=target))
                else:
                    wanted.append(Wanted(layer.filename, target, choices[target]))
        with self._lock:
            self._layers.sync(wanted, lambda c, t: self._make_worker(c, None, monitor, params, t),
                              qemu_alive=qemu_alive)

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
        return replaced or self._chain_changed(monitor)

    def _chain_changed(self, monitor: Monitor) -> list[str]:
        """Disks with a managed layer no chain has any more (block pull, commit): resync them."""
        layers = self._layers.paths()
        if not layers:
            return []
        try:
            files = {f for chain in self._chains(monitor).values() for f in chain}
        except VmcacheError as err:
            self._log.debug(event("disk.chains_unknown", error=err))
            return []
        changed = sorted({target for path, target in layers.items() if path not in files})
        for target in changed:
            self._log.info(event("disk.chain_changed", disk=target))
        return changed

    def workers(self) -> list[DiskWorker]:
        """The workers of the managed disks (the saved hot set reads their engines)."""
        return list(self._workers.values())

    def budgets(self) -> dict[str, int]:
        """Each managed disk's budget, by target: the most it may pin (see :meth:`total_budget`)."""
        return {target: w.budget for target, w in self._workers.items()}

    def total_budget(self) -> int:
        """The most the managed disks may pin together (settings/policy.py ``total_budget`` of their choices)."""
        return total_budget(c for t, c in self._chosen.items() if t in self._workers)

    def cycle(self, budgets: Mapping[str, int], *, title: str) -> SetCycle:
        """One cycle of every disk under its granted bytes; heat-map files written after."""
        backing_off = resync = False
        with self._lock:
            self._layers.retry()
        for target, worker in list(self._workers.items()):
            was_failing = worker.failing
            for member, part in self._members(target, worker, budgets.get(target, 0)):
                with self._lock:
                    stats = member.cycle(part)
                if stats is None:
                    continue
                backing_off |= stats.backing_off
                member.write_heatmap(title)
            resync |= worker.failing and not was_failing
        self._refs.clear()  # once for all disks: each engine read its pages' bits since the last clear
        every = [*self._workers.values(), *self._layers.workers()]
        error = next((w.status.error for w in every if w.status.error), None)
        return SetCycle(backing_off=backing_off, resync=resync, error=error)

    def _members(self, target: str, top: DiskWorker, granted: int) -> list[tuple[DiskWorker, int]]:
        """The top and the layers of disk ``target``, each with its part of the disk's ``granted`` bytes.

        Each may take up to the disk's budget; the grant goes to the densest bytes of all of them
        (model/budget.py divide_disks, by their curves of the last cycle).
        """
        members = {target: top, **{w.image: w for w in self._layers.workers(target)}}
        if len(members) == 1:
            return [(top, granted)]
        parts = divide_disks({k: top.budget for k in members}, 1.0, granted, self._curves.get(target, {}))
        return [(w, parts.get(k, 0)) for k, w in members.items()]

    def demands(self, share: float) -> dict[str, Curve]:
        """Each disk's demand curve after its last cycle, at its budget times ``share`` (its layers' merged in)."""
        out = {}
        with self._lock:
            for target, top in self._workers.items():
                members = {target: top, **{w.image: w for w in self._layers.workers(target)}}
                curves = {k: w.demand(share) for k, w in members.items()}
                self._curves[target] = curves
                out[target] = domain_curve({k: top.budget for k in members}, share, curves)
        return out

    def pinned_bytes(self) -> int:
        """Bytes the disks (and the layers this agent manages) hold pinned after their last cycle."""
        return sum(w.pinned_bytes for w in self._workers.values()) + self._layers.pinned_bytes()

    def rebind(self, monitor: Monitor) -> None:
        """Give every worker a new monitor (libvirtd reconnected)."""
        for worker in self._workers.values():
            worker.rebind(monitor)

    def statuses(self) -> list[DiskStatus]:
        """Every disk's status: managed ones, then the ones left alone."""
        return [w.status for w in self._workers.values()] + self._layers.statuses() + self._skipped

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
        """Drop every disk and layer (model change, shutdown); one failing close does not stop the others."""
        self._layers.close_all(qemu_alive=qemu_alive)
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
