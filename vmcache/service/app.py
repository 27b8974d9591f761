"""The composition root of ``vmcache agent``: every collaborator built from the host config.

The agent (:mod:`vmcache.service.agent`) only runs its lifecycle and loop;
what it talks to is made here, with the production readers and writers as
defaults, so a test can build the same agent with its own.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ..host.hotstore import HotStore
from ..host.rungate import RunGate
from ..host.runlock import RUN_LOCK_DIR, RunLock
from ..host.warmpool import WarmPool
from ..host.ledger import Ledger
from ..host.memcg import MemcgRoom
from ..host.meminfo import MemoryPressure, read_meminfo, read_pressure
from ..host.pagerefs import PageRefs
from ..host.qmp import Monitor
from ..host.readcount import qemu_pid
from ..host.virtdomain import DEFAULT_URI, connect
from ..logfmt import domain_logger
from ..model.params import ModelParams
from ..observe.heatmap import HeatmapWriter, RenderOptions
from ..host.files import file_stem, nbd_dir
from ..settings.config import HostConfig
from ..settings.policy import DiskChoice
from .agent import Agent
from .signalsafe import SignalSafeEvent
from .budget import Budget
from .configwatch import ConfigWatch
from .diskset import DiskSet, WorkerFactory
from .diskworker import DiskWorker
from .domainlink import DomainLink
from .earlypin import ENV as EARLY_PIN_ENV, EarlyPins
from .enginepolicy import EnginePolicy
from .hotsets import HotSetKeeper
from .layers import Layers
from .readsignal import ReadSignal
from .reconcile import ReconcileRequest
from .telemetry import Telemetry

__all__ = ["build_agent"]


def build_agent(domain: str, config: HostConfig, *, uri: str = DEFAULT_URI, domain_id: int | None = None,
                connect_: Callable[[str], Any] = connect, granularity: int = 64 * 1024,
                pressure: Callable[[], MemoryPressure | None] | None = None,
                config_path: str | None = None, reads: ReadSignal | None = None) -> Agent:
    """The agent of ``domain`` on libvirt at ``uri``, wired to this host.

    ``domain_id``: the run (libvirt domain id) to follow, None for the one
    running when the agent attaches; ``pressure`` reads memory PSI (default:
    /proc/pressure/memory); ``config_path``: the file ``config`` was read
    from, watched for changes (None: not watched); ``reads`` counts the
    guest's reads (default: the host's read counter, joined when the first
    disk starts).
    """
    logger = domain_logger("vmcache.service.agent", domain)
    wake = SignalSafeEvent()  # the agent's signal handler sets it
    telemetry = Telemetry(domain, config)
    link = DomainLink(domain, uri, connect=connect_, wake=wake, domain_id=domain_id, gate=RunGate(RUN_LOCK_DIR))
    refs = PageRefs()  # referenced bits of pinned pages, shared by the disks
    uuid = lambda: link.uuid  # noqa: E731 - known once the link attached, before the first worker
    qemu_user = lambda: link.qemu_user  # noqa: E731 - likewise; QEMU binds the NBD socket as this user
    layers = Layers(domain, os.path.join(config.runtime_dir, "layers"), logger=logger)
    reads = reads or ReadSignal(domain, logger=logger)
    disks = DiskSet(config, _worker_factory(domain, config, telemetry, uuid, qemu_user, refs, granularity, logger,
                                            reads),
                    refs=refs, logger=logger, layers=layers)
    budget = Budget(domain, Ledger(config.ledger_path, None), cap=config.pinned_cap,
                    psi_threshold=config.psi_threshold, pressure=pressure or read_pressure,
                    meminfo=read_meminfo, logger=logger)
    store = (HotStore(config.hotset_dir, keep=config.hotset_keep, max_age=config.hotset_max_age)
             if config.hotset_dir is not None else None)
    hotsets = HotSetKeeper(link.virt, every=config.hotset_interval, logger=logger, store=store, uuid=uuid)
    watch = ConfigWatch(config_path, logger=logger) if config_path is not None else None
    reconcile = ReconcileRequest(config, config_path, uri, logger=logger) if config_path is not None else None
    return Agent(domain, config, link=link, disks=disks, budget=budget, telemetry=telemetry, wake=wake,
                 available_memory=lambda: read_meminfo().available_bytes, hotsets=hotsets, run_lock=RunLock(),
                 config_watch=watch, request_reconcile=reconcile, reads=reads,
                 early_pins=EarlyPins(logger) if os.environ.get(EARLY_PIN_ENV) == "1" else None)


def _worker_factory(domain: str, config: HostConfig, telemetry: Telemetry, uuid: Callable[[], str],
                    qemu_user: Callable[[], tuple[int, int] | None], refs: PageRefs, granularity: int,
                    logger: Any, reads: ReadSignal) -> WorkerFactory:
    runtime_dir = nbd_dir(config.runtime_dir, domain)
    # pins are charged to QEMU's cgroup (the guest read them) or the agent's (it loaded them)
    memcg = MemcgRoom(lambda: (qemu_pid(domain), os.getpid()))
    policy = EnginePolicy(floor_bytes=config.min_free, room=memcg.room, apart=memcg.apart, pressure=memcg.pressure,
                          prefetch_rate=config.prefetch_rate, warm_rate=config.warm_rate, fill=config.fill == "whole",
                          decide_on_reads=config.read_model == "counted",
                          warm_pool=WarmPool(config.warmup_path, config.warm_rate, burst=config.interval),
                          domain=domain)

    def make(choice: DiskChoice, node: str | None, monitor: Monitor, params: ModelParams,
             layer_of: str | None) -> DiskWorker:
        return DiskWorker(choice, node=node, monitor=monitor, params=params, policy=policy, refs=refs,
                          runtime_dir=runtime_dir, socket_owner=qemu_user(), granularity=granularity,
                          metrics=telemetry.metrics(uuid()), logger=logger,
                          heatmap=None if layer_of else _heatmap_writer(domain, choice.disk.target, config),
                          layer_of=layer_of, reads=reads)

    return make


def _heatmap_writer(domain: str, target: str, config: HostConfig) -> HeatmapWriter | None:
    """The writer of one disk's heat-map files, when the config asks for them."""
    if not config.heatmap.every:
        return None
    os.makedirs(config.heatmap.dir, mode=0o755, exist_ok=True)
    base = os.path.join(config.heatmap.dir, f"{file_stem(domain)}-{target}")
    return HeatmapWriter(base + ".png", json_path=base + ".json", every=config.heatmap.every,
                         options=RenderOptions(blocks_per_pixel=config.heatmap.blocks_per_pixel,
                                               aspect=config.heatmap.aspect))
