"""The per-domain agent: ``vmcache agent --domain NAME``.

Started by the libvirt hook (through :mod:`vmcache.service.launcher`) when an
opted-in domain starts. It connects to libvirt, finds the domain's disks
that go through the host page cache, and for each runs a
:class:`~vmcache.service.diskworker.DiskWorker` once per interval. Around that it:

- follows the domain's events: stops when the domain stops, re-reads its
  metadata when it changes (budget, exclusions, model; disabled -> exit),
  re-syncs its disks on hotplug/unplug;
- survives libvirtd restarts: keeps its pins, reconnects, carries on;
- asks the host-wide ledger for its share of the pinned-bytes cap;
- backs off under host memory pressure: each disk's pinner releases its
  lowest-priority pins while MemAvailable is under the floor, and while
  memory PSI (``some avg10``) is above the host config's ``psi_threshold`` the agent
  halves its pinned budget every cycle (the planner drops the
  lowest-priority regions first), doubling it back once PSI falls under
  half the threshold;
- serves Prometheus metrics and keeps a file_sd targets file;
- writes its status file for ``vmcache status``;
- on SIGTERM / domain stop: removes its bitmaps and exports (while QEMU is
  there), unpins, releases its ledger share, removes its files.

Exit codes: 0 for a clean stop (domain gone, disabled, SIGTERM), 1 for a
failure the service manager may restart it for.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from .. import __version__
from ..settings.config import HostConfig
from .diskworker import DiskWorker
from ..errors import ConfigError, DomainError, VmcacheError
from ..observe.exporter import BasicAuth, TLSOptions, serve_metrics
from ..observe.filesd import TargetsFile
from ..observe.heatmap import HeatmapData, HeatmapWriter, RenderOptions, heatmap_page
from ..host.blockdev import discover_disks
from ..host.ledger import Ledger
from ..host.meminfo import MemoryPressure, read_meminfo, read_pressure
from ..host.pagerefs import PageRefs
from ..host.qmp import LibvirtMonitor
from ..host.virtdomain import DEFAULT_URI, connect
from ..host.virtevents import DomainEvents, EventLoop
from .launcher import remove_own_pidfile
from ..logfmt import domain_logger, event
from ..settings.metadata import DomainInfo, parse_domain
from ..observe.metrics import AgentMetrics
from ..settings.policy import choose_disks, domain_budget
from ..observe.status import AgentStatus, DiskStatus, file_stem, status_path, write_status

__all__ = ["Agent", "EXIT_OK", "EXIT_FAILURE", "nbd_dir"]

EXIT_OK = 0
EXIT_FAILURE = 1
RECONNECT_SECONDS = 2.0
#: Smallest budget share under PSI pressure before it drops to nothing.
_MIN_SHARE = 1 / 8


def nbd_dir(runtime_dir: str, domain: str) -> str:
    """The directory (0700) of ``domain``'s NBD sockets under ``runtime_dir``.

    Per domain: libvirt names nodes alike in every domain (libvirt-1-storage), and
    the tracker names its NBD socket after the node. Short: a socket path has 108 bytes.
    """
    return os.path.join(runtime_dir, "nbd", hashlib.sha256(domain.encode()).hexdigest()[:12])


class Agent:
    """One domain's agent; :meth:`run` until the domain stops or a signal arrives."""

    def __init__(self, domain: str, config: HostConfig, *, uri: str = DEFAULT_URI,
                 connect_: Callable[[str], Any] = connect, granularity: int = 64 * 1024,
                 pressure: Callable[[], MemoryPressure | None] = read_pressure) -> None:
        self.domain = domain
        self.config = config
        self.uri = uri
        self._connect = connect_
        self._granularity = granularity
        self._pressure = pressure
        self._share = 1.0  # of the budget, shrunk under memory pressure (PSI)
        self._log = domain_logger("vmcache.service.agent", domain)
        self._stop = threading.Event()
        self._refs = PageRefs()  # referenced bits of pinned pages, shared by the disks
        self._state_lock = threading.Lock()  # the loop's cycles vs heat maps served over HTTP
        self._wake = threading.Event()
        self._conn: Any = None
        self._dom: Any = None
        self._events: DomainEvents | None = None
        self._info: DomainInfo | None = None
        self._workers: dict[str, DiskWorker] = {}
        self._skipped: list[DiskStatus] = []
        self._resync = False
        self._ledger = Ledger(config.ledger_path, None)
        self._metrics: AgentMetrics | None = None
        self._server: Any = None
        self._targets: TargetsFile | None = None
        self._heatmaps: dict[str, HeatmapWriter] = {}
        self.status = AgentStatus(domain=domain, pid=os.getpid(), started_at=time.time(),
                                  interval=config.interval)
        self._status_path = status_path(config.agents_dir, domain)
        self.nbd_dir = nbd_dir(config.runtime_dir, domain)

    # -- lifecycle -----------------------------------------------------------------

    def request_stop(self, *_: object) -> None:
        """Ask the loop to stop (signal handler)."""
        self._stop.set()
        self._wake.set()

    def run(self) -> int:
        """Run until the domain stops, vmcache is disabled for it, or a stop is requested."""
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self.request_stop)
        code = EXIT_OK
        try:
            EventLoop.ensure()
            self._attach()
            if self._info is None or self._info.settings is None or not self._info.settings.enabled:
                self._log.info(event("agent.not_enabled"))
                self.status.state = "disabled"
                return EXIT_OK
            self._start_metrics()
            self._sync_disks()
            self._loop()
        except VmcacheError as err:
            self._log.error(event("agent.failed", error=err))
            self.status.last_error = str(err)
            code = EXIT_FAILURE
        finally:
            self._shutdown()
        return code

    def _attach(self) -> None:
        """Connect, look the domain up, subscribe to its events, read its XML."""
        import libvirt

        self._conn = self._connect(self.uri)
        try:
            self._dom = self._conn.lookupByName(self.domain)
        except libvirt.libvirtError as err:
            raise DomainError(f"domain {self.domain!r}: {err.get_error_message()}") from err
        self._events = DomainEvents(self._conn, self._dom, self._wake)
        self._info = self._read_xml()
        self.status.uuid = self._info.uuid

    def _read_xml(self) -> DomainInfo:
        import libvirt

        try:
            xml = self._dom.XMLDesc(0)
        except libvirt.libvirtError as err:
            raise DomainError(f"domain {self.domain!r}: cannot read XML: {err.get_error_message()}") from err
        return parse_domain(xml)

    def _alive(self) -> bool:
        import libvirt

        try:
            return bool(self._dom is not None and self._dom.isActive())
        except libvirt.libvirtError:
            return False

    # -- the loop ------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            pending = self._events.poll() if self._events else None
            if pending and pending.disconnected:
                self._reconnect()
            elif pending and pending.stopped or not self._alive():
                if not self._reconnect_if_gone():
                    self._log.info(event("agent.domain_stopped"))
                    return
            if pending and pending.metadata_changed and not self._reload():
                return
            if pending and (pending.devices_changed or pending.metadata_changed) or self._resync:
                # A disk whose cycle failed may have been replaced (blockcopy pivot, media
                # change: no device event): the XML says what its image is now.
                self._resync = False
                self._sync_disks()
            self._cycle()
            self._wake.clear()
            self._wake.wait(max(0.0, self.config.interval - (time.monotonic() - started)))

    def _pressure_share(self) -> float:
        """The share of the budget to pin this cycle: halved per cycle under PSI pressure."""
        try:
            psi = self._pressure()
        except VmcacheError as err:
            self._log.warning(event("psi.unreadable", error=err))
            return self._share
        level = psi.some.avg10 if psi is not None else 0.0
        threshold = self.config.psi_threshold
        before = self._share
        if level > threshold:
            self._share = 0.0 if self._share <= _MIN_SHARE else self._share / 2
        elif level < threshold / 2 and self._share < 1.0:
            self._share = min(1.0, max(_MIN_SHARE, self._share * 2))
        if self._share != before:
            self._log.info(event("psi.share", psi_some_avg10=level, threshold=threshold,
                                 share=f"{self._share:g}"))
        return self._share

    def _cycle(self) -> None:
        mem = read_meminfo()
        cap = self.config.pinned_cap.bytes_for(mem.total_bytes)
        self._ledger.cap = cap
        share = self._pressure_share()
        want = int(sum(w.budget for w in self._workers.values()) * share)
        granted = self._ledger.reserve(self.domain, want)
        self.status.budget_bytes = want
        self.status.granted_bytes = granted
        backing_off = share < 1.0
        for target, worker in list(self._workers.items()):
            budget = int(worker.budget * share)
            with self._state_lock:
                stats = worker.cycle(budget if granted >= want or want == 0 else budget * granted // want)
            if stats is not None:
                backing_off |= stats.backing_off
                writer = self._heatmaps.get(target)
                if writer is not None:
                    try:
                        writer.cycle(lambda w=worker: w.engine.heatmap_data(w.target, title=self.domain))
                    except VmcacheError as err:
                        self._log.warning(event("heatmap.failed", disk=target, error=err))
        self._refs.clear()  # once for all disks: each engine read its pages' bits since the last clear
        held = sum(w.engine.last.pinned_bytes for w in self._workers.values() if w.engine.last)
        self._ledger.reserve(self.domain, held)
        if self._metrics:
            self._metrics.set_host_memory(read_meminfo().available_bytes)
        self.status.state = "backing-off" if backing_off else "running"
        self.status.last_error = next((w.status.error for w in self._workers.values() if w.status.error), None)
        self._resync = self.status.last_error is not None
        self._write_status()

    def _reload(self) -> bool:
        """Metadata changed: re-read it. False when vmcache was disabled for the domain."""
        try:
            self._info = self._read_xml()
        except (DomainError, ConfigError) as err:
            self._log.warning(event("agent.metadata_unusable", error=err))
            self.status.last_error = str(err)
            return True
        settings = self._info.settings
        if settings is None or not settings.enabled:
            self._log.info(event("agent.disabled"))
            return False
        self._log.info(event("agent.metadata_changed", budget=domain_budget(settings, self.config)))
        # Budgets and exclusions are applied by _sync_disks; model changes need new engines.
        for target in list(self._workers):
            self._drop(target)
        return True

    def _reconnect_if_gone(self) -> bool:
        """The domain looks stopped: is it really, or did libvirtd go away? True to carry on."""
        if self._alive():
            return True
        try:
            self._conn.getLibVersion()
        except Exception:  # noqa: BLE001 - any failure here means the connection is gone
            return self._reconnect()
        return False

    def _reconnect(self) -> bool:
        """libvirtd went away: keep the pins, reconnect until it is back. True once reconnected."""
        self._log.warning(event("agent.libvirt_lost"))
        self.status.last_error = "libvirtd connection lost; reconnecting"
        self._write_status()
        if self._events:
            self._events.close()
            self._events = None
        while not self._stop.is_set():
            try:
                self._attach()
            except VmcacheError as err:
                self._log.info(event("agent.reconnect_failed", error=err))
                self._stop.wait(RECONNECT_SECONDS)
                continue
            if not self._alive():
                return False
            monitor = LibvirtMonitor(self._dom)
            for worker in self._workers.values():
                if worker.tracker is not None:
                    worker.tracker.monitor = monitor
            self._log.info(event("agent.reconnected"))
            self.status.last_error = None
            return True
        return False

    # -- disks ---------------------------------------------------------------------

    def _sync_disks(self) -> None:
        """Make the workers match the domain's eligible disks (start, hotplug, unplug, metadata)."""
        assert self._info is not None and self._info.settings is not None
        try:
            self._info = self._read_xml()
        except (DomainError, ConfigError) as err:
            self._log.warning(event("agent.xml_unusable", error=err))
            return
        settings = self._info.settings
        if settings is None:
            return
        params = self.config.model_params(settings.model)
        choices = choose_disks(self._info.disks, settings, self.config)
        wanted = {c.disk.target: c for c in choices if c.eligible}
        for target in [t for t in self._workers if t not in wanted or
                       self._workers[t].image != wanted[t].disk.source]:
            self._drop(target)
        self._skipped = [DiskStatus(target=c.disk.target, source=c.disk.source, cache=c.disk.cache_mode,
                                    eligible=False, reason=c.reason) for c in choices if not c.eligible]
        for skipped in self._skipped:
            self._log.info(event("disk.skipped", disk=skipped.target, reason=skipped.reason))
        if not wanted.keys() - self._workers.keys():
            for target, choice in wanted.items():
                self._workers[target].budget = choice.budget
            return
        monitor = LibvirtMonitor(self._dom)
        try:
            nodes = {d.filename: d for d in discover_disks(monitor)}
        except VmcacheError as err:
            self._log.warning(event("disk.discovery_failed", error=err))
            nodes = {}
        for target, choice in wanted.items():
            if target in self._workers:
                self._workers[target].budget = choice.budget
                continue
            node = nodes.get(choice.disk.source or "")
            if node is not None and node.direct:
                self._skipped.append(DiskStatus(target=target, source=choice.disk.source, cache=choice.disk.cache_mode,
                                                eligible=False, reason="QEMU opened it with O_DIRECT"))
                continue
            try:
                self._workers[target] = DiskWorker(
                    choice, node=node.storage_node if node else None, monitor=monitor, params=params,
                    floor_bytes=self.config.min_free, prefetch_rate=self.config.prefetch_rate, refs=self._refs,
                    runtime_dir=self.nbd_dir,
                    granularity=self._granularity, metrics=self._metrics_or_new(), logger=self._log)
            except VmcacheError as err:
                self._log.warning(event("disk.start_failed", disk=target, error=err))
                continue
            if self.config.heatmap.every:
                os.makedirs(self.config.heatmap.dir, mode=0o755, exist_ok=True)
                base = os.path.join(self.config.heatmap.dir, f"{file_stem(self.domain)}-{target}")
                self._heatmaps[target] = HeatmapWriter(
                    base + ".png", json_path=base + ".json", every=self.config.heatmap.every,
                    options=RenderOptions(blocks_per_pixel=self.config.heatmap.blocks_per_pixel,
                                          aspect=self.config.heatmap.aspect))
            self._log.info(event("disk.managed", disk=target, image=choice.disk.source, budget=choice.budget,
                                 node=node.storage_node if node else None))

    def _drop(self, target: str) -> None:
        with self._state_lock:
            worker = self._workers.pop(target)
        self._heatmaps.pop(target, None)
        worker.close(qemu_alive=self._alive())
        self._log.info(event("disk.dropped", disk=target))

    # -- metrics and status --------------------------------------------------------

    def _metrics_or_new(self) -> AgentMetrics:
        if self._metrics is None:
            self._metrics = AgentMetrics(self.domain, self.status.uuid, version=__version__)
        return self._metrics

    def _heatmap_data(self, disk: str) -> HeatmapData | None:
        """A managed disk's heat map as of its last cycle (served at /heatmap/<disk>.png)."""
        with self._state_lock:
            worker = self._workers.get(disk)
            if worker is None or worker.engine.residency is None:
                return None
            return worker.engine.heatmap_data(disk, title=self.domain)

    def _start_metrics(self) -> None:
        metrics = self._metrics_or_new()
        m = self.config.metrics
        try:
            tls = auth = None
            if m.tls is not None:
                tls = TLSOptions(certfile=m.tls.certfile, keyfile=m.tls.keyfile, client_cafile=m.tls.client_cafile,
                                 client_auth_required=m.tls.client_auth_required)
            if m.basic_auth is not None:
                auth = BasicAuth(m.basic_auth.username, m.basic_auth.password_file)
            options = RenderOptions(blocks_per_pixel=self.config.heatmap.blocks_per_pixel,
                                    aspect=self.config.heatmap.aspect)
            self._server = serve_metrics(metrics.registry, address=m.listen, ports=m.ports, tls=tls, basic_auth=auth,
                                         pages=lambda path: heatmap_page(path, self._heatmap_data, options))
            self._targets = TargetsFile(self.domain, self.status.uuid, self._server.target,
                                        directory=os.path.join(self.config.runtime_dir, "prometheus"))
            self._targets.write()
            self.status.metrics_url = self._server.url
        except VmcacheError as err:
            # Metrics are an add-on: the agent pins without them.
            self._log.warning(event("metrics.unavailable", error=err))
            self.status.last_error = f"metrics: {err}"

    def _write_status(self) -> None:
        self.status.disks = [w.status for w in self._workers.values()] + self._skipped
        try:
            write_status(self._status_path, self.status)
        except VmcacheError as err:
            self._log.warning(event("status.write_failed", error=err))

    def _shutdown(self) -> None:
        """Leave nothing behind: bitmaps, exports, pins, ledger share, files, server."""
        self.status.state = "stopping"
        alive = self._alive()
        for target in list(self._workers):
            try:
                self._drop(target)
            except Exception as err:  # noqa: BLE001 - keep cleaning up the rest
                self._log.error(event("disk.close_failed", disk=target, error=err))
        for cleanup in (lambda: self._ledger.release(self.domain),
                        lambda: self._targets and self._targets.remove(),
                        lambda: self._server and self._server.close(),
                        lambda: self._events and self._events.close()):
            try:
                cleanup()
            except Exception as err:  # noqa: BLE001 - keep cleaning up the rest
                self._log.warning(event("agent.cleanup_failed", error=err))
        try:
            os.rmdir(self.nbd_dir)  # empty once the trackers stopped
        except FileNotFoundError:
            pass
        except OSError as err:
            self._log.warning(event("agent.nbd_dir_left", path=self.nbd_dir, error=err))
        try:
            os.unlink(self._status_path)
        except FileNotFoundError:
            pass
        except OSError as err:
            self._log.warning(event("status.remove_failed", error=err))
        self._log.info(event("agent.stopped", qemu_alive=alive, version=__version__))
        remove_own_pidfile()  # last: the lock it guards ends with this process
