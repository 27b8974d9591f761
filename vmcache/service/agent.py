"""The per-domain agent's lifecycle and loop: ``vmcache agent --domain NAME``.

Started by the libvirt hook (through :mod:`vmcache.service.launcher`) when an
opted-in domain starts; built by :func:`vmcache.service.app.build_agent`.
On a live migration's destination the hook starts it as the domain comes in:
it waits until the migration has ended before it sends QEMU anything or pins
(:func:`~vmcache.service.incoming.await_arrival`).
Once per interval the loop

1. picks up the domain's events (:class:`~vmcache.service.domainlink.DomainLink`):
   stops when the domain stops, re-reads its metadata when it changes
   (budget, exclusions, model; disabled -> exit), re-syncs its disks on
   hotplug/unplug or when a disk starts failing; reconnects when libvirtd
   went away, keeping its pins; notices a changed host config
   (:class:`~vmcache.service.configwatch.ConfigWatch`): applies its host
   rules (no longer managed -> exit) and asks for a reconcile of every
   domain (``vmcache reconcile``);
2. asks its :class:`~vmcache.service.budget.Budget` for this cycle's bytes
   (memory-pressure back-off, the host-wide cap);
3. runs every disk once (:class:`~vmcache.service.diskset.DiskSet`) and
   records what the disks really hold;
4. writes its status file for ``vmcache status``;
5. keeps the regions its disks hold in the domain's live XML, cycle by
   cycle, and every ``hotset_interval`` saves them in its persistent XML and
   the host's copy too (:class:`~vmcache.service.hotsets.HotSetKeeper`),
   which the next agent warms from (after a restart, restore, migration).

On SIGTERM / domain stop it saves the hot set once more, removes its
bitmaps and exports (while QEMU is there), unpins, releases its ledger
share, removes its files.

Exit codes: 0 for a clean stop (domain gone, disabled, SIGTERM), 1 for a
failure the service manager may restart it for.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

from .. import __version__
from ..errors import ConfigError, DomainError, RunClaimedError, RunEndedError, VmcacheError
from ..host.files import nbd_dir
from ..host.runlock import RunLock
from ..logfmt import domain_logger, event
from ..observe.status import AgentStatus, status_path, write_status
from ..settings.config import HostConfig
from ..settings.metadata import DomainInfo
from ..model.share import Curve
from ..settings.policy import domain_budget, domain_minimum
from .configwatch import ConfigWatch
from .budget import Budget
from .diskset import DiskSet
from .domainlink import DomainLink
from .earlypin import EarlyPins
from .hotsets import HotSetKeeper
from .incoming import await_arrival
from .detached import remove_own_pidfile
from .management import Management
from .readsignal import ReadSignal
from .signalsafe import SignalSafeEvent
from .telemetry import Telemetry

__all__ = ["Agent", "EXIT_OK", "EXIT_FAILURE"]

EXIT_OK = 0
EXIT_FAILURE = 1
RECONNECT_SECONDS = 2.0


class Agent:
    """One domain's agent; :meth:`run` until the domain stops or a stop is requested."""

    def __init__(self, domain: str, config: HostConfig, *, link: DomainLink, disks: DiskSet, budget: Budget,
                 telemetry: Telemetry, wake: threading.Event, available_memory: Callable[[], int],
                 clock: Callable[[], float] = time.monotonic, hotsets: HotSetKeeper | None = None,
                 run_lock: RunLock | None = None, config_watch: ConfigWatch | None = None,
                 request_reconcile: Callable[[], None] | None = None, reads: ReadSignal | None = None,
                 early_pins: EarlyPins | None = None) -> None:
        """``wake`` is set by the link's events and by :meth:`request_stop` to end the wait between cycles;
        ``hotsets``: loads and saves the domain's hot set (None: the agent neither warms nor saves);
        ``run_lock``: claimed for the run once attached, so no second agent manages it (None: not claimed);
        ``config_watch``: tells a changed host config (None: the one given is kept), after which
        ``request_reconcile`` is called; ``reads``: the disks' read counter, let go at the end (None: reads
        inferred); ``early_pins``: tests only (vmcache.service.earlypin), None everywhere else."""
        self.domain = domain
        self.config = config
        self.nbd_dir = nbd_dir(config.runtime_dir, domain)
        self._link = link
        self._disks = disks
        self._budget = budget
        self._curves: dict[str, Curve] = {}  # each disk's demand curve from its last cycle
        self._telemetry = telemetry
        self._wake = wake
        self._available_memory = available_memory
        self._clock = clock
        self._hotsets = hotsets
        self._run_lock = run_lock
        self._config_watch = config_watch
        self._request_reconcile = request_reconcile
        self._management = Management(config.rules)
        self._reads = reads
        self._early_pins = early_pins
        self._log = domain_logger("vmcache.service.agent", domain)
        self._stop = SignalSafeEvent()  # set by the signal handler
        self._info: DomainInfo | None = None
        self._resync = False
        self.status = AgentStatus(domain=domain, pid=os.getpid(), started_at=time.time(), interval=config.interval)
        self._status_path = status_path(config.agents_dir, domain)

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
            self._attach()
            if self._run_lock is not None and self._link.domain_id is not None:
                self._run_lock.claim(self._link.uuid, self._link.domain_id)
            self._link.open_gate()  # before any QMP command, and only by the run's one agent
            if not self._enabled():
                self._log.info(event("agent.not_enabled"))
                self.status.state = "disabled"
                return EXIT_OK
            self._start_telemetry()
            if not await_arrival(self._link, wake=self._wake, stopping=self._stop.is_set, clock=self._clock,
                                 log=self._log, waiting=self._migrating, early_pins=self._early_pins):
                return EXIT_OK
            if self._hotsets is not None:
                self._hotsets.load()
                self.status.hotset_source = self._hotsets.source
            self._sync_disks()
            if self._hotsets is not None:
                self._hotsets.warm_all(self._disks.workers())
            self._loop()
        except RunEndedError as err:
            self._log.info(event("agent.run_ended", error=err))
        except RunClaimedError as err:  # not a failure to restart for: the run is managed
            self._log.error(event("agent.refused", error=err))
            self.status.last_error = str(err)
        except VmcacheError as err:
            self._log.error(event("agent.failed", error=err))
            self.status.last_error = str(err)
            code = EXIT_FAILURE
        finally:
            self._shutdown()
        return code

    def _attach(self) -> None:
        self._info = self._effective(self._link.attach())
        self.status.uuid = self._info.uuid
        self.status.domain_id = self._link.domain_id

    def _migrating(self) -> None:
        self.status.state = "migrating"
        self._write_status()

    def _enabled(self) -> bool:
        return self._info is not None and self._info.settings is not None and self._info.settings.enabled

    def _loop(self) -> None:
        while not self._stop.is_set():
            started = self._clock()
            # Cleared before the events are read, so that a stop or an event arriving during the
            # cycle ends the wait below at once instead of being cleared with it.
            self._wake.clear()
            if not self._follow_events() or self._stop.is_set():
                return
            self._cycle()
            if self._hotsets is not None:
                self._hotsets.follow(self._disks.workers(), managed=self._management.still_managed)
                self.status.hotset_saved_at = self._hotsets.saved_at
            self._wake.wait(max(0.0, self.config.interval - (self._clock() - started)))

    def _follow_events(self) -> bool:
        """Act on what happened since the last cycle; False when the agent should stop."""
        pending = self._link.poll()
        if pending.disconnected:
            self._reconnect()
        elif pending.stopped or not self._link.alive():
            if not self._reconnect_if_gone():
                self._log.info(event("agent.domain_stopped"))
                return False
        if pending.metadata_changed and not self._reload():
            return False
        changed = self._config_watch.poll() if self._config_watch is not None else None
        if changed is not None and not self._apply_config(changed):
            return False
        # A snapshot or a block-job pivot replaces a disk's image; a snapshot sends no event at all.
        if (pending.devices_changed or pending.metadata_changed or self._resync
                or self._disks.replaced(self._link.monitor())):
            self._resync = False
            self._sync_disks()
        return True

    def _cycle(self) -> None:
        grant = self._budget.grant(self._disks.budgets(), self._curves, held=self._disks.pinned_bytes(),
                                   total=self._disks.total_budget())
        self.status.budget_bytes = grant.want
        self.status.granted_bytes = grant.target
        self.status.demand_bytes = grant.demand
        self.status.minimum_bytes = grant.minimum
        self.status.share_error = grant.error
        result = self._disks.cycle(grant.disks, title=self.domain)
        self._budget.hold(self._disks.pinned_bytes())
        # the demand the next cycle publishes: each disk's plan at its full budget, after this cycle's step
        self._curves = self._disks.demands(grant.share)
        self._telemetry.set_share(grant.want, grant.target, grant.demand, grant.minimum, grant.cap)
        self._telemetry.set_host_memory(self._available_memory())
        if self._reads is not None:
            self.status.read_signal, self.status.read_signal_reason = self._reads.signal, self._reads.reason
            self._telemetry.set_read_signal(self._reads.signal)
        self.status.state = "backing-off" if grant.backing_off or result.backing_off else "running"
        self.status.last_error = result.error
        self._resync = result.resync
        self._write_status()

    def _effective(self, info: DomainInfo) -> DomainInfo:
        effective = self._management.effective(info)
        self.status.managed_by = self._management.why
        return effective

    def _apply_config(self, config: HostConfig) -> bool:
        """A changed, valid host config: ask for a reconcile, apply its rules. False when no longer managed.

        Only the rules are taken up by a running agent; the other keys apply to agents started after.
        """
        if self._request_reconcile is not None:
            self._request_reconcile()
        if not self._management.take_rules(config.rules):
            return True
        self._resync = True  # budgets, minimum: applied by the disks' sync
        return self._reload(what="agent.rules_changed")

    def _reload(self, what: str = "agent.metadata_changed") -> bool:
        """Metadata (or the host rules) changed: re-read it. False when vmcache no longer manages the domain.

        The disks keep their engines - heat and pins - unless the model's
        parameters changed: budgets, minimums and exclusions are applied by
        :meth:`_sync_disks`, and the event also comes for other programs'
        metadata (libvirt names only the namespace).
        """
        before = self._info.settings if self._info is not None else None
        try:
            self._info = self._effective(self._link.read_xml())
        except (DomainError, ConfigError) as err:
            self._log.warning(event("agent.metadata_unusable", error=err))
            self.status.last_error = str(err)
            return True
        settings = self._info.settings
        if settings is None or not settings.enabled:
            self._log.info(event("agent.disabled", why=self.status.managed_by))
            return False
        model_changed = before is None or dict(before.model) != dict(settings.model)
        self._log.info(event(what, budget=domain_budget(settings, self.config), managed_by=self.status.managed_by,
                             engines="rebuilt" if model_changed else "kept"))
        if model_changed:
            self._disks.drop_all(qemu_alive=self._link.alive())
        return True

    def _sync_disks(self) -> None:
        """Re-read the XML; make the disks match it (a failed read keeps them as they are)."""
        try:
            self._info = self._effective(self._link.read_xml())
        except (DomainError, ConfigError) as err:
            self._log.warning(event("agent.xml_unusable", error=err))
            return
        self._disks.sync(self._info, self._link.monitor, qemu_alive=self._link.alive)
        if self._info.settings is not None:
            self._budget.minimum = domain_minimum(self._info.settings, self.config)

    # -- libvirtd restarts ---------------------------------------------------------

    def _reconnect_if_gone(self) -> bool:
        """The domain looks stopped: is it really, or did libvirtd go away? True to carry on."""
        if self._link.alive():
            return True
        return not self._link.connected() and self._reconnect()

    def _reconnect(self) -> bool:
        """libvirtd went away: keep the pins, reconnect until it is back. True once reconnected."""
        self._log.warning(event("agent.libvirt_lost"))
        self.status.last_error = "libvirtd connection lost; reconnecting"
        self._write_status()
        self._link.close()
        while not self._stop.is_set():
            try:
                self._attach()
            except RunEndedError as err:
                self._log.info(event("agent.run_ended", error=err))
                return False
            except VmcacheError as err:
                self._log.info(event("agent.reconnect_failed", error=err))
                self._stop.wait(RECONNECT_SECONDS)
                continue
            if not self._link.alive():
                return False
            self._disks.rebind(self._link.monitor())
            self._log.info(event("agent.reconnected"))
            self.status.last_error = None
            return True
        return False

    # -- status and teardown -------------------------------------------------------

    def _start_telemetry(self) -> None:
        try:
            self.status.metrics_url = self._telemetry.start(
                self.status.uuid, lambda disk: self._disks.heatmap_data(disk, title=self.domain))
        except VmcacheError as err:
            # Metrics are an add-on: the agent pins without them.
            self._log.warning(event("metrics.unavailable", error=err))
            self.status.last_error = f"metrics: {err}"

    def _write_status(self) -> None:
        self.status.disks = self._disks.statuses()
        try:
            write_status(self._status_path, self.status)
        except VmcacheError as err:
            self._log.warning(event("status.write_failed", error=err))

    def _save_hotset(self, *, live: bool) -> None:
        assert self._hotsets is not None
        self._hotsets.save(self._disks.workers(), live=live, managed=self._management.still_managed)
        self.status.hotset_saved_at = self._hotsets.saved_at

    def _shutdown(self) -> None:
        """Leave nothing behind: bitmaps, exports, pins, ledger share, files, server."""
        self.status.state = "stopping"
        alive = self._link.alive()
        if self._hotsets is not None and self._hotsets.every and self._disks.workers():
            self._save_hotset(live=alive)  # before the pins go: what the next start warms from
        self._disks.drop_all(qemu_alive=alive)
        closers = [self._budget.release, self._telemetry.close, self._link.end]
        if self._reads is not None:
            closers.insert(0, self._reads.close)
        for cleanup in closers:
            try:
                cleanup()
            except Exception as err:  # noqa: BLE001 - keep cleaning up the rest
                self._log.warning(event("agent.cleanup_failed", error=err))
        for path, remove, name in ((self.nbd_dir, os.rmdir, "agent.nbd_dir_left"),  # empty once trackers stopped
                                   (self._status_path, os.unlink, "status.remove_failed")):
            try:
                remove(path)
            except FileNotFoundError:
                pass
            except OSError as err:
                self._log.warning(event(name, path=path, error=err))
        self._log.info(event("agent.stopped", qemu_alive=alive, version=__version__))
        if self._run_lock is not None:
            self._run_lock.release()
        remove_own_pidfile()  # last: the lock it guards ends with this process
