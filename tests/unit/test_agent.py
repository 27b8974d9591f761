"""The agent's loop driven with fakes: events, resync, budget, reconnect, teardown.

The live tests (tests/live/) run the same agent against real libvirtd/QEMU;
these check the loop's decisions one at a time.
"""

from __future__ import annotations

import os

import json
import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from vmcache.errors import DomainError, RunEndedError
from vmcache.host.ledger import Ledger
from vmcache.host.runlock import RunLock
from vmcache.host.meminfo import MemInfo, MemoryPressure, PressureLine
from vmcache.host.virtevents import Pending
from vmcache.model.stats import CycleStats
from vmcache.observe.status import DiskStatus, status_path
from vmcache.service.agent import EXIT_FAILURE, EXIT_OK, Agent
from vmcache.service.budget import Budget
from vmcache.service.diskset import DiskSet
from vmcache.settings.config import HostConfig, PinnedCap
from vmcache.settings.metadata import DiskInfo, DomainInfo, DomainSettings
from vmcache.settings.rules import Match, Rule
from vmcache.model.extents import BitmapRead

MiB = 1 << 20
LOG = logging.getLogger("test.agent")


def _info(*disks: str, enabled: bool = True, budget: int = 64 * MiB, minimum: int | None = None) -> DomainInfo:
    return DomainInfo("d", "uuid-1", tuple(DiskInfo(t, source=f"/img/{t}.raw", cache="writethrough") for t in disks),
                      DomainSettings(enabled=enabled, budget=budget, minimum=minimum))


class FakeLink:
    """The domain in libvirt: XML and events scripted per cycle; stops the agent when the script ends."""

    def __init__(self, info: DomainInfo, events: list[Pending], agent: list[Agent]) -> None:
        self.info = info
        self.events = deque(events)
        self.agent = agent
        self.running = True
        self.xml_reads = 0
        self.attaches = 0
        self.monitors = 0
        self.up = True
        self.domain_id = 5
        self.uuid = info.uuid
        self.incoming_answers: deque[bool] = deque()  # incoming() answers, then False

    def attach(self) -> DomainInfo:
        self.attaches += 1
        return self.info

    def read_xml(self) -> DomainInfo:
        self.xml_reads += 1
        return self.info

    def poll(self) -> Pending:
        if not self.events:
            self.agent[0].request_stop()
            return Pending()
        return self.events.popleft()

    def incoming(self) -> bool:
        return self.incoming_answers.popleft() if self.incoming_answers else False

    def alive(self) -> bool:
        return self.running

    def connected(self) -> bool:
        return self.up

    def monitor(self) -> str:
        self.monitors += 1
        return f"monitor-{self.attaches}"  # the connection's

    def close(self) -> None:
        pass

    def end(self) -> None:
        self.ended = True

    def open_gate(self) -> None:
        pass


@dataclass
class FakeWorker:
    target: str
    image: str
    budget: int
    monitor: Any
    fail: bool = False
    budgets: list[int] = field(default_factory=list)
    closed: bool | None = None
    pinned_bytes: int = 0
    failing: bool = False
    curve: tuple[tuple[int, float], ...] = ()
    status: DiskStatus = field(init=False)

    def __post_init__(self) -> None:
        self.status = DiskStatus(target=self.target, source=self.image, cache="writethrough", eligible=True)

    def cycle(self, budget: int) -> CycleStats | None:
        self.budgets.append(budget)
        self.failing = self.fail
        self.status.error = "image gone" if self.fail else None
        if self.fail:
            return None
        self.pinned_bytes = budget
        return CycleStats(now=0.0, duration_seconds=0.0, size_bytes=0, budget_bytes=budget, pinned_bytes=budget,
                          pinned_regions=1, resident_bytes=budget, guest_written_bytes=0, guest_read_miss_bytes=0,
                          recently_evicted_pages=None, bitmap_read=BitmapRead.OK, mem_available_bytes=0, backing_off=False)

    def demand(self, share: float) -> tuple[tuple[int, float], ...]:
        return self.curve

    def rebind(self, monitor: Any) -> None:
        self.monitor = monitor

    def write_heatmap(self, title: str) -> None:
        pass

    def heatmap_data(self, title: str) -> None:
        return None

    def close(self, *, qemu_alive: bool = True) -> None:
        self.closed = qemu_alive


class FakeTelemetry:
    def start(self, uuid: str, heatmaps: Any) -> str:
        return "http://127.0.0.1:1/metrics"

    def set_host_memory(self, available: int) -> None:
        pass

    def set_share(self, budget: int, granted: int, demand: int, minimum: int, cap: int | None) -> None:
        self.share = (budget, granted, demand, minimum, cap)

    def close(self) -> None:
        pass


class FakeRefs:
    def clear(self) -> None:
        pass


@dataclass
class Harness:
    agent: Agent
    link: FakeLink
    workers: dict[str, FakeWorker]
    config: HostConfig

    def status(self) -> dict[str, Any]:
        return json.loads(Path(status_path(self.config.agents_dir, "d")).read_text())


class RecordingWake(threading.Event):
    """The loop's wake-up event; ``wait`` returns at once, recording whether it would have (set) or slept."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[bool] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(self.is_set())
        return self.is_set()


def harness(tmp_path: Path, info: DomainInfo, events: list[Pending], *, psi: list[float] | None = None,
            failing: set[str] = frozenset(), cap: int | None = None,  # type: ignore[assignment]
            interval: float = 0.001, wake: threading.Event | None = None, run_lock: RunLock | None = None,
            rules: tuple[Rule, ...] = (), config_watch: Any = None, request_reconcile: Any = None) -> Harness:
    config = HostConfig(interval=interval, runtime_dir=str(tmp_path / "run"), rules=rules,
                        pinned_cap=PinnedCap() if cap is None else PinnedCap(size=cap, fraction=None))
    holder: list[Agent] = []
    link = FakeLink(info, events, holder)
    workers: dict[str, FakeWorker] = {}

    def make(choice: Any, node: Any, monitor: Any, params: Any, layer_of: Any = None) -> FakeWorker:
        worker = FakeWorker(choice.disk.target, choice.disk.source, choice.budget, monitor,
                            fail=choice.disk.target in failing)
        workers[worker.target] = worker
        return worker

    levels = deque(psi or [])

    def pressure() -> MemoryPressure:
        return MemoryPressure(PressureLine(levels.popleft() if levels else 0.0, 0.0, 0.0, 0), None)

    total = 16 << 30
    budget = Budget("d", Ledger(config.ledger_path, None), cap=config.pinned_cap, psi_threshold=10.0,
                    pressure=pressure, meminfo=lambda: MemInfo(total, total, total, 0, 0, 0, 0), logger=LOG)
    disks = DiskSet(config, make, refs=FakeRefs(), logger=LOG, discover=lambda _m: [],  # type: ignore[arg-type]
                    images=lambda _m: {os.path.realpath(d.source or '') for d in link.info.disks})
    agent = Agent("d", config, link=link, disks=disks, budget=budget,  # type: ignore[arg-type]
                  telemetry=FakeTelemetry(), wake=wake or threading.Event(), available_memory=lambda: total,  # type: ignore[arg-type]
                  run_lock=run_lock, config_watch=config_watch, request_reconcile=request_reconcile)
    holder.append(agent)
    return Harness(agent, link, workers, config)


def test_runs_every_disk_under_its_share_and_cleans_up_when_stopped(tmp_path: Path) -> None:
    h = harness(tmp_path, _info("vda", "vdb"), [Pending(), Pending()])
    statuses: list[dict[str, Any]] = []
    real_write = h.agent._write_status

    def spy() -> None:
        real_write()
        statuses.append(h.status())

    h.agent._write_status = spy  # type: ignore[method-assign]
    assert h.agent.run() == EXIT_OK
    assert h.workers["vda"].budgets == [32 * MiB] * 2 and h.workers["vdb"].budgets == [32 * MiB] * 2
    assert statuses[-1]["state"] == "running" and statuses[-1]["granted_bytes"] == 64 * MiB
    assert [d["target"] for d in statuses[-1]["disks"]] == ["vda", "vdb"]
    assert all(w.closed is True for w in h.workers.values())  # QEMU alive: bitmaps removed
    assert not Path(status_path(h.config.agents_dir, "d")).exists()
    assert "d" not in Ledger(h.config.ledger_path, None).entries()


def test_the_agent_publishes_its_demand_and_divides_its_grant_between_disks_by_it(tmp_path: Path) -> None:
    from vmcache.model.share import Demand

    h = harness(tmp_path, _info("vda", "vdb", minimum=8 * MiB), [Pending()] * 3, cap=40 * MiB)
    # another domain's agent holds nothing but asks for 20 MiB of dense bytes
    Ledger(h.config.ledger_path, 40 * MiB, pid=os.getppid()).divide(
        "other", Demand(budget=20 * MiB, curve=((20 * MiB, 20 * MiB * 0.9),)))
    statuses: list[dict[str, Any]] = []
    shares: list[dict[str, Any]] = []
    real_write = h.agent._write_status

    def spy() -> None:
        real_write()
        statuses.append(h.status())
        shares.append(json.loads(Path(h.config.ledger_path).with_name("share.json").read_text()))
        for w in h.workers.values():  # after the first cycle the disks know their heat: vdb is hot, vda cold
            w.curve = ((4 * MiB, 4 * MiB * 0.1),) if w.target == "vda" else ((32 * MiB, 32 * MiB * 0.5),)

    h.agent._write_status = spy  # type: ignore[method-assign]
    assert h.agent.run() == EXIT_OK
    # first cycle: no curves anywhere but other's: other 20 MiB (dense), this domain the rest, prorated
    assert h.workers["vda"].budgets[0] == h.workers["vdb"].budgets[0] == 10 * MiB
    # then its grant goes to vdb's denser bytes first
    assert (h.workers["vda"].budgets[-1], h.workers["vdb"].budgets[-1]) == (0, 20 * MiB)
    last = statuses[-1]
    assert last["granted_bytes"] == 20 * MiB and last["demand_bytes"] == 36 * MiB and last["minimum_bytes"] == 8 * MiB
    assert shares[-1]["domains"]["d"]["min"] == 8 * MiB and shares[-1]["domains"]["d"]["budget"] == 64 * MiB
    assert "d" not in json.loads(Path(h.config.ledger_path).with_name("share.json").read_text())["domains"]


def test_a_disk_with_a_lasting_error_resyncs_once_not_every_cycle(tmp_path: Path) -> None:
    h = harness(tmp_path, _info("vda"), [Pending()] * 6, failing={"vda"})
    assert h.agent.run() == EXIT_OK
    assert len(h.workers["vda"].budgets) == 6
    # One read at start, one when the disk started failing; none for the cycles after.
    assert h.link.xml_reads == 2


def test_psi_over_the_threshold_halves_each_disks_budget_per_cycle(tmp_path: Path) -> None:
    h = harness(tmp_path, _info("vda"), [Pending()] * 4, psi=[0.0, 40.0, 40.0, 1.0])
    assert h.agent.run() == EXIT_OK
    assert h.workers["vda"].budgets == [64 * MiB, 32 * MiB, 16 * MiB, 32 * MiB]


def test_domain_stop_event_ends_the_loop_and_does_not_ask_a_dead_qemu(tmp_path: Path) -> None:
    h = harness(tmp_path, _info("vda"), [Pending()])

    def stopped() -> Pending:
        h.link.running = False
        return Pending(stopped=True)

    h.link.poll = lambda: h.link.events.popleft() if h.link.events else stopped()  # type: ignore[method-assign]
    assert h.agent.run() == EXIT_OK
    assert h.workers["vda"].budgets == [64 * MiB]
    assert h.workers["vda"].closed is False  # QEMU gone: nothing asked of it


def test_disabled_in_metadata_exits_and_a_hotplug_is_synced(tmp_path: Path) -> None:
    h = harness(tmp_path, _info("vda"), [Pending(), Pending(devices_changed=True), Pending()])
    original = h.link.poll

    def poll() -> Pending:
        pending = original()
        if pending.devices_changed:
            h.link.info = _info("vda", "vdb")
        return pending

    h.link.poll = poll  # type: ignore[method-assign]
    assert h.agent.run() == EXIT_OK
    assert h.workers["vda"].budgets == [64 * MiB, 32 * MiB, 32 * MiB]
    assert h.workers["vdb"].budgets == [32 * MiB, 32 * MiB]

    off = harness(tmp_path / "off", _info("vda"), [Pending(), Pending(metadata_changed=True), Pending()])
    after_first = off.link.poll

    def disable() -> Pending:
        pending = after_first()
        if pending.metadata_changed:
            off.link.info = _info("vda", enabled=False)
        return pending

    off.link.poll = disable  # type: ignore[method-assign]
    assert off.agent.run() == EXIT_OK
    assert off.workers["vda"].budgets == [64 * MiB] and off.workers["vda"].closed is True


def test_a_metadata_change_keeps_each_disks_engine_unless_the_model_changed(tmp_path: Path) -> None:
    """Heat and pins survive a budget change, and another program's metadata; a new model rebuilds."""
    from dataclasses import replace

    changes = deque([_info("vda"), _info("vda", budget=32 * MiB), None])
    h = harness(tmp_path, _info("vda"), [Pending()] + [Pending(metadata_changed=True)] * 3 + [Pending()])
    original = h.link.poll
    seen: list[FakeWorker] = []

    def poll() -> Pending:
        pending = original()
        seen.append(h.workers["vda"])
        if pending.metadata_changed:
            info = changes.popleft()
            settings = DomainSettings(enabled=True, budget=32 * MiB, model=MappingProxyType({"decay": 0.9}))
            h.link.info = info or replace(h.link.info, settings=settings)
        return pending

    h.link.poll = poll  # type: ignore[method-assign]
    assert h.agent.run() == EXIT_OK
    first = seen[0]
    assert seen[1] is first and seen[2] is first  # unchanged (another namespace's event), then the budget halved
    assert first.budgets[:3] == [64 * MiB, 64 * MiB, 32 * MiB]
    assert h.workers["vda"] is not first and first.closed is True  # the model changed: a new engine


def test_libvirtd_lost_reconnects_and_rebinds_the_workers(tmp_path: Path) -> None:
    h = harness(tmp_path, _info("vda"), [Pending(), Pending(disconnected=True), Pending()])
    assert h.agent.run() == EXIT_OK
    assert h.link.attaches == 2
    assert h.workers["vda"].monitor == "monitor-2"  # the new connection's monitor
    assert len(h.workers["vda"].budgets) == 3


def test_a_failed_attach_exits_with_failure_and_leaves_nothing(tmp_path: Path) -> None:
    h = harness(tmp_path, _info("vda"), [])

    def refuse() -> DomainInfo:
        raise DomainError("domain 'd': Domain not found")

    h.link.attach = refuse  # type: ignore[method-assign]
    assert h.agent.run() == EXIT_FAILURE
    assert not Path(status_path(h.config.agents_dir, "d")).exists()


def test_not_enabled_at_start_exits_without_managing_anything(tmp_path: Path) -> None:
    h = harness(tmp_path, _info("vda", enabled=False), [Pending()])
    assert h.agent.run() == EXIT_OK and h.workers == {}


def test_a_stop_requested_during_a_cycle_ends_the_wait_at_once(tmp_path: Path) -> None:
    wake = RecordingWake()
    h = harness(tmp_path, _info("vda"), [Pending()] * 5, interval=3600.0, wake=wake)
    first_cycle = FakeWorker.cycle

    def cycle_then_stop(worker: FakeWorker, budget: int) -> CycleStats | None:
        h.agent.request_stop()  # SIGTERM arrives while the disks cycle
        return first_cycle(worker, budget)

    FakeWorker.cycle = cycle_then_stop  # type: ignore[method-assign,assignment]
    try:
        assert h.agent.run() == EXIT_OK
    finally:
        FakeWorker.cycle = first_cycle  # type: ignore[method-assign]
    assert len(h.workers["vda"].budgets) == 1
    assert wake.waits == [True]  # the wait after the cycle did not sleep the hour


def test_an_agent_whose_run_is_over_exits_cleanly_without_managing_anything(tmp_path: Path) -> None:
    h = harness(tmp_path, _info("vda"), [Pending()])

    def over() -> DomainInfo:
        raise RunEndedError("domain 'd': run 5 is over (it runs as 6 now)")

    h.link.attach = over  # type: ignore[method-assign]
    assert h.agent.run() == EXIT_OK
    assert h.workers == {} and not Path(status_path(h.config.agents_dir, "d")).exists()


def test_a_disk_whose_image_was_replaced_without_an_event_is_followed(tmp_path: Path) -> None:
    """An external snapshot changes vda's image and sends no event: the per-cycle image check resyncs."""
    h = harness(tmp_path, _info("vda"), [Pending(), Pending(), Pending()])
    original = h.link.poll
    polls = []

    def poll() -> Pending:
        polls.append(1)
        if len(polls) == 2:
            h.link.info = DomainInfo("d", "uuid-1", (DiskInfo("vda", source="/img/vda-s1.qcow2",
                                                              cache="writethrough"),), h.link.info.settings)
        return original()

    h.link.poll = poll  # type: ignore[method-assign]
    closed = []
    real_close = FakeWorker.close

    def close(worker: FakeWorker, *, qemu_alive: bool = True) -> None:
        closed.append((worker.image, qemu_alive))
        real_close(worker, qemu_alive=qemu_alive)

    FakeWorker.close = close  # type: ignore[method-assign,assignment]
    try:
        assert h.agent.run() == EXIT_OK
    finally:
        FakeWorker.close = real_close  # type: ignore[method-assign]
    assert h.workers["vda"].image == "/img/vda-s1.qcow2"
    assert closed[0] == ("/img/vda.raw", True)  # the old image's bitmap removed, its pins released
    assert len(h.workers["vda"].budgets) == 2  # the new image's worker ran the cycles after the change


def test_a_second_agent_of_a_run_is_refused_and_touches_nothing(tmp_path: Path) -> None:
    """Another config's agent holds the run (its lock): this one manages no disk and exits cleanly."""
    other = RunLock(str(tmp_path / "locks"))
    other.claim("uuid-1", 5)
    h = harness(tmp_path, _info("vda"), [Pending()], run_lock=RunLock(str(tmp_path / "locks")))
    assert h.agent.run() == EXIT_OK
    assert h.workers == {}  # no disk started: no bitmap of the other agent's removed as stale
    assert "managed by agent pid" in (h.agent.status.last_error or "")
    other.release()


def test_the_run_lock_is_held_while_the_agent_runs_and_removed_after(tmp_path: Path) -> None:
    lock = RunLock(str(tmp_path / "locks"))
    h = harness(tmp_path, _info("vda"), [Pending()], run_lock=lock)
    seen: list[bool] = []
    real_write = h.agent._write_status

    def spy() -> None:
        real_write()
        seen.append(os.path.exists(tmp_path / "locks" / "uuid-1.5.lock"))

    h.agent._write_status = spy  # type: ignore[method-assign]
    assert h.agent.run() == EXIT_OK
    assert seen and all(seen)
    assert not os.listdir(tmp_path / "locks")


def _bare(*disks: str) -> DomainInfo:
    """A domain whose XML has no vmcache metadata (what Nova defines)."""
    return DomainInfo("d", "uuid-1", tuple(DiskInfo(t, source=f"/img/{t}.raw", cache="writethrough") for t in disks),
                      None)


class ScriptedWatch:
    """A ConfigWatch whose polls return the configs given, one per cycle (None: unchanged)."""

    def __init__(self, *configs: HostConfig | None) -> None:
        self.configs = deque(configs)

    def poll(self) -> HostConfig | None:
        return self.configs.popleft() if self.configs else None


def test_a_host_rule_manages_a_domain_without_metadata_with_its_budget(tmp_path: Path) -> None:
    rule = Rule(1, Match(name="d"), budget=48 * MiB)
    h = harness(tmp_path, _bare("vda"), [Pending()] * 2, rules=(rule,))
    assert h.agent.run() == EXIT_OK
    assert h.workers["vda"].budgets == [48 * MiB] * 2
    assert h.agent.status.managed_by == "rule 1: name=d" and h.agent.status.budget_bytes == 48 * MiB


def test_without_metadata_or_a_matching_rule_the_agent_does_nothing(tmp_path: Path) -> None:
    h = harness(tmp_path, _bare("vda"), [Pending()], rules=(Rule(1, Match(name="web-*")),))
    assert h.agent.run() == EXIT_OK
    assert h.workers == {}
    assert h.agent.status.managed_by == "no vmcache metadata, no rule matches"


def test_a_changed_config_asks_for_a_reconcile_and_its_rules_apply_at_once(tmp_path: Path) -> None:
    """New budget from a changed rule; then a config whose rules leave the domain out: the agent exits."""
    first = Rule(1, Match(name="d"), budget=48 * MiB)
    wider = HostConfig(rules=(Rule(1, Match(name="d*"), budget=16 * MiB),))
    other = HostConfig(rules=(Rule(1, Match(name="web-*")),))
    asked: list[int] = []
    h = harness(tmp_path, _bare("vda"), [Pending()] * 6, rules=(first,),
                config_watch=ScriptedWatch(None, wider, None, other), request_reconcile=lambda: asked.append(1))
    assert h.agent.run() == EXIT_OK
    assert h.workers["vda"].budgets == [48 * MiB, 16 * MiB, 16 * MiB]  # stopped before a fourth cycle
    assert h.workers["vda"].closed is True and len(asked) == 2
    assert h.agent.status.managed_by == "no vmcache metadata, no rule matches"


def test_the_domains_metadata_still_wins_over_a_changed_rule(tmp_path: Path) -> None:
    h = harness(tmp_path, _info("vda", budget=8 * MiB), [Pending()] * 3,
                config_watch=ScriptedWatch(HostConfig(rules=(Rule(1, Match(name="d"), budget=MiB),))))
    assert h.agent.run() == EXIT_OK
    assert h.workers["vda"].budgets == [8 * MiB] * 3 and h.agent.status.managed_by == "metadata"


def test_on_a_migrations_destination_the_agent_waits_until_the_domain_is_in(tmp_path: Path) -> None:
    """While the domain comes in (libvirt holds its job; the source still runs the guest) the agent sends
    QEMU nothing and starts no disk; it says so in its status; once the domain is in it starts as usual."""
    wake = RecordingWake()
    h = harness(tmp_path, _info("vda"), [Pending()], wake=wake)
    h.link.incoming_answers.extend([True, True, True])
    seen: list[tuple[str, int, int]] = []
    real_write = h.agent._write_status

    def spy() -> None:
        real_write()
        seen.append((h.status()["state"], h.link.monitors, len(h.workers)))

    h.agent._write_status = spy  # type: ignore[method-assign]
    assert h.agent.run() == EXIT_OK
    assert seen[0] == ("migrating", 0, 0)
    assert len(wake.waits) >= 2  # waited between the looks at the domain's state
    assert len(h.workers["vda"].budgets) == 1


def test_a_domain_that_goes_away_while_coming_in_ends_the_agent_without_a_disk(tmp_path: Path) -> None:
    """A migration that fails: libvirt kills the destination's QEMU; the waiting agent exits cleanly."""
    h = harness(tmp_path, _info("vda"), [Pending()], wake=RecordingWake())
    h.link.incoming_answers.extend([True] * 5)
    real_incoming = h.link.incoming

    def incoming() -> bool:
        if len(h.link.incoming_answers) == 3:
            h.link.running = False
        return real_incoming()

    h.link.incoming = incoming  # type: ignore[method-assign]
    assert h.agent.run() == EXIT_OK
    assert h.workers == {} and not Path(status_path(h.config.agents_dir, "d")).exists()
