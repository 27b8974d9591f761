"""HotSetKeeper: loads once, warms matching disks only, saves where the domain keeps it, never raises."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from vmcache.errors import ConfigError, DomainError, DomainGoneError
from vmcache.host.hotstore import HotStore
from vmcache.host.imageid import image_id
from vmcache.host.virtdomain import Affect
from vmcache.model.params import ModelParams
from vmcache.model.region import Region
from vmcache.model.warm import WarmStart
from vmcache.service.hotsets import HotSetKeeper
from vmcache.settings.hotset import DiskHotSet, HotSet, build_hotset, parse_hotset
from vmcache.settings.metadata import DomainSettings

MiB = 1 << 20
P = ModelParams(block_size=MiB)


@dataclass
class FakeDomain:
    saved: dict[int, str] = field(default_factory=dict)  # affect flag -> element, as libvirt keeps it
    settings_: DomainSettings | None = DomainSettings()
    persistent: bool = True
    fail: Exception | None = None

    def hotset(self, affect: Affect = Affect.CURRENT) -> HotSet | None:
        if self.fail:
            raise self.fail
        xml = self.saved.get(int(affect))
        return None if xml is None else parse_hotset(xml)

    def set_hotset(self, hotset: HotSet | None, affect: Affect = Affect.CURRENT) -> None:
        if self.fail:
            raise self.fail
        for flag in (Affect.LIVE, Affect.CONFIG):
            if affect & flag:
                if hotset is None:
                    self.saved.pop(int(flag), None)
                else:
                    self.saved[int(flag)] = build_hotset(hotset)

    def settings(self, affect: Affect = Affect.CURRENT) -> DomainSettings | None:
        return self.settings_

    def is_persistent(self) -> bool:
        return self.persistent

    def job(self) -> str | None:
        return self.busy

    busy: str | None = None


@dataclass
class FakeResidency:
    size_bytes: int


class FakeEngine:
    params = P

    def __init__(self, regions: list[Region], size: int, *, backing_off: bool = False) -> None:
        self._regions = regions
        self.residency: Any = FakeResidency(size)
        self.warm: WarmStart | None = None
        self.last: Any = type("Stats", (), {"backing_off": backing_off})()
        self.asked: list[bool] = []  # per hot_regions call, whether it asked for the recent ranking
        self.now: list[Region] | None = None  # what the recent ranking gives, where it differs

    def hot_regions(self, *, recent: bool = False) -> list[Region]:
        self.asked.append(recent)
        return self.now if recent and self.now is not None else self._regions

    def first_reads(self, regions: list[Region]) -> tuple[int, ...]:
        return tuple(range(1, len(regions) + 1))


@dataclass
class Disk:
    target: str
    image: str
    engine: FakeEngine


@pytest.fixture
def image(tmp_path):
    path = tmp_path / "web.img"
    with open(path, "wb") as f:
        f.truncate(64 * MiB)
    return str(path)


def _keeper(dom: FakeDomain, clock: list[float] | None = None) -> HotSetKeeper:
    now = clock or [0.0]
    return HotSetKeeper(lambda: dom, every=300.0, logger=logging.getLogger("test.hotsets"), clock=lambda: now[0],
                        wall=lambda: 1795430400.0)


def test_save_then_a_new_agent_warms_the_same_image(image, caplog):
    caplog.set_level(logging.INFO)
    dom = FakeDomain()
    held = [Region(8 * MiB, 4 * MiB, 4.0), Region(32 * MiB, 2 * MiB, 1.0)]
    assert _keeper(dom).save([Disk("vda", image, FakeEngine(held, 64 * MiB))], live=True)
    assert set(dom.saved) == {int(Affect.LIVE), int(Affect.CONFIG)}  # running, persistent: both definitions
    (record,) = parse_hotset(dom.saved[int(Affect.LIVE)]).disks
    assert record.image_id == image_id(image) is not None  # the image got its id when a set was saved for it

    keeper = _keeper(dom)
    keeper.load()
    disk = Disk("vda", image, FakeEngine([], 64 * MiB))
    keeper.warm(disk)
    assert disk.engine.warm is not None and disk.engine.warm.total_bytes == 6 * MiB
    assert "hotset.warming disk=vda" in caplog.text
    other = Disk("vda", image, FakeEngine([], 64 * MiB))
    keeper.warm(other)  # a record warms one engine once (a re-created worker starts as the model says)
    assert other.engine.warm is None


@pytest.mark.parametrize("persistent", [True, False])
def test_a_set_saved_after_the_run_began_is_read_from_the_persistent_definition(image, caplog, persistent):
    """A start right after a stop: the live definition was copied before the stopping agent saved."""
    caplog.set_level(logging.INFO)
    stopped = FakeDomain()
    _keeper(stopped).save([Disk("vda", image, FakeEngine([Region(8 * MiB, 4 * MiB, 4.0)], 64 * MiB))], live=False)
    assert set(stopped.saved) == {int(Affect.CONFIG)}
    dom = FakeDomain(saved=dict(stopped.saved), persistent=persistent)  # the new run's live definition has none

    keeper = _keeper(dom)
    keeper.load()
    disk = Disk("vda", image, FakeEngine([], 64 * MiB))
    keeper.warm(disk)
    if persistent:
        assert disk.engine.warm is not None and disk.engine.warm.total_bytes == 4 * MiB
        assert "hotset.loaded disks=1" in caplog.text and "definition=persistent" in caplog.text
    else:  # a transient domain has no persistent definition to ask
        assert disk.engine.warm is None and "hotset.none" in caplog.text


@pytest.mark.parametrize("change, reason", [
    ("resize", "bytes"),
    ("replace", "replaced"),
    ("rename", "no managed disk vda now"),
])
def test_a_changed_image_ignores_the_saved_set(image, caplog, change, reason):
    dom = FakeDomain()
    _keeper(dom).save([Disk("vda", image, FakeEngine([Region(0, MiB, 1.0)], 64 * MiB))], live=True)
    target = "vda"
    if change == "resize":
        os.truncate(image, 128 * MiB)
    elif change == "replace":  # cp/qemu-img convert to a new file, then mv over the old one
        os.unlink(image)
        with open(image, "wb") as f:
            f.truncate(64 * MiB)
    else:
        target = "vdb"  # the same image, attached under another name
    keeper = _keeper(dom)
    keeper.load()
    disk = Disk(target, image, FakeEngine([], 64 * MiB))
    keeper.warm_all([disk])
    assert disk.engine.warm is None
    assert "hotset.ignored disk=vda" in caplog.text and reason in caplog.text


def test_unusable_saved_set_is_one_line_and_a_cold_start(image, caplog):
    dom = FakeDomain(fail=ConfigError("hotset version", "9", "not a version this vmcache reads (1)"))
    keeper = _keeper(dom)
    keeper.load()
    disk = Disk("vda", image, FakeEngine([], 64 * MiB))
    keeper.warm(disk)
    assert disk.engine.warm is None
    (line,) = [r.getMessage() for r in caplog.records if "hotset.unusable" in r.getMessage()]
    assert "cold start" in line and "\n" not in line


def test_nothing_saved_when_disabled_or_removed_or_transient_and_stopped(image):
    disks = [Disk("vda", image, FakeEngine([Region(0, MiB, 1.0)], 64 * MiB))]
    for settings in (None, DomainSettings(enabled=False)):
        dom = FakeDomain(settings_=settings)
        assert not _keeper(dom).save(disks, live=True) and not dom.saved
    transient = FakeDomain(persistent=False)
    assert not _keeper(transient).save(disks, live=False) and not transient.saved
    assert _keeper(transient).save(disks, live=True) and set(transient.saved) == {int(Affect.LIVE)}


def test_nothing_held_removes_the_saved_set(image):
    dom = FakeDomain()
    _keeper(dom).save([Disk("vda", image, FakeEngine([Region(0, MiB, 1.0)], 64 * MiB))], live=True)
    assert dom.saved
    _keeper(dom).save([Disk("vda", image, FakeEngine([], 64 * MiB))], live=True)
    assert not dom.saved


def test_libvirt_failure_is_logged_not_raised(image, caplog):
    dom = FakeDomain(fail=DomainError("web-1: cannot set the hot set: domain is not running"))
    assert not _keeper(dom).save([Disk("vda", image, FakeEngine([Region(0, MiB, 1.0)], 64 * MiB))], live=True)
    assert "hotset.save_failed" in caplog.text


def test_the_stop_of_a_transient_domain_that_is_gone_is_no_failure(image, caplog):
    caplog.set_level("INFO")
    class Gone(FakeDomain):
        def is_persistent(self) -> bool:
            raise DomainGoneError("web-1: cannot get persistence: Domain not found")

    dom = Gone()
    assert not _keeper(dom).save([Disk("vda", image, FakeEngine([Region(0, MiB, 1.0)], 64 * MiB))], live=False)
    assert "hotset.save_failed" not in caplog.text and "the domain is gone" in caplog.text


def test_a_disk_still_warming_keeps_the_set_it_started_from(image):
    dom = FakeDomain()
    saved = [Region(i * 4 * MiB, MiB, 2.0) for i in range(10)]
    _keeper(dom).save([Disk("vda", image, FakeEngine(saved, 64 * MiB))], live=True)
    keeper = _keeper(dom)
    keeper.load()
    disk = Disk("vda", image, FakeEngine([Region(0, MiB, 2.0)], 64 * MiB))  # one region restored so far
    keeper.warm(disk)
    keeper.save([disk], live=True)
    (record,) = parse_hotset(dom.saved[int(Affect.LIVE)]).disks
    assert len(record.regions) == 10


def test_a_disk_backing_off_keeps_the_set_it_had(image):
    dom = FakeDomain()
    keeper = _keeper(dom)
    held = [Region(i * 4 * MiB, MiB, 2.0) for i in range(8)]
    keeper.save([Disk("vda", image, FakeEngine(held, 64 * MiB))], live=True)
    keeper.save([Disk("vda", image, FakeEngine(held[:1], 64 * MiB, backing_off=True))], live=True)
    assert len(parse_hotset(dom.saved[int(Affect.LIVE)]).disks[0].regions) == 8  # pressure cut it, not the guest
    keeper.save([Disk("vda", image, FakeEngine(held[:2], 64 * MiB))], live=True)
    assert len(parse_hotset(dom.saved[int(Affect.LIVE)]).disks[0].regions) == 2  # the guest moved on


def test_saves_are_due_every_interval():
    now = [100.0]
    keeper = _keeper(FakeDomain(), now)
    assert not keeper.due()
    now[0] = 399.0
    assert not keeper.due()
    now[0] = 400.0
    assert keeper.due()
    never = HotSetKeeper(FakeDomain, every=0.0, logger=logging.getLogger("t"))
    assert not never.due()


def test_saved_set_round_trips_through_the_record(image):
    dom = FakeDomain()
    record = DiskHotSet("vda", image, 64 * MiB, None, MiB, (Region(0, MiB, 1.0),))
    dom.set_hotset(HotSet(saved=1, disks=(record,)), Affect.LIVE)
    keeper = _keeper(dom)
    keeper.load()
    disk = Disk("vda", image, FakeEngine([], 64 * MiB))
    keeper.warm(disk)  # no id saved (a file system without xattrs): path and size decide
    assert disk.engine.warm is not None


# -- the host's copy (vmcache.host.hotstore) ----------------------------------------------------------

UUID = "6f1c0d2a-8b2e-4bbc-811a-9ad2023a0426"


def _stored(dom: FakeDomain, store: HotStore, now: list[float] | None = None,
            wall: float = 1795430400.0) -> HotSetKeeper:
    clock = now or [0.0]
    return HotSetKeeper(lambda: dom, every=300.0, logger=logging.getLogger("test.hotsets"), clock=lambda: clock[0],
                        wall=lambda: wall, store=store, uuid=lambda: UUID)


def test_every_save_writes_the_hosts_copy_too_root_only(image, tmp_path):
    store = HotStore(str(tmp_path / "hotsets"))
    dom = FakeDomain()
    held = [Region(8 * MiB, 4 * MiB, 4.0)]
    assert _stored(dom, store).save([Disk("vda", image, FakeEngine(held, 64 * MiB))], live=True)
    copy = store.load(UUID)
    assert copy is not None and copy == parse_hotset(dom.saved[int(Affect.LIVE)])
    path = tmp_path / "hotsets" / f"{UUID}.xml"
    assert path.stat().st_mode & 0o777 == 0o600 and (tmp_path / "hotsets").stat().st_mode & 0o777 == 0o700
    # nothing held any more: both go (the host's copy would otherwise be the newest set)
    assert _stored(dom, store).save([Disk("vda", image, FakeEngine([], 64 * MiB))], live=True)
    assert not dom.saved and store.load(UUID) is None


def test_a_domain_defined_afresh_warms_from_the_hosts_copy(image, tmp_path, caplog):
    """What Nova does on a hard reboot: undefine, define the XML without vmcache's elements, start."""
    caplog.set_level(logging.INFO)
    store = HotStore(str(tmp_path / "hotsets"))
    held = [Region(8 * MiB, 4 * MiB, 4.0)]
    _stored(FakeDomain(), store).save([Disk("vda", image, FakeEngine(held, 64 * MiB))], live=False)
    fresh = FakeDomain()  # no element in either definition
    keeper = _stored(fresh, store)
    keeper.load()
    disk = Disk("vda", image, FakeEngine([], 64 * MiB))
    keeper.warm_all([disk])
    assert keeper.source == "host" and disk.engine.warm is not None and disk.engine.warm.total_bytes == 4 * MiB
    assert "hotset.loaded disks=1 saved=1795430400 definition=host" in caplog.text


@pytest.mark.parametrize("newer", ["live", "host"])
def test_the_newest_valid_set_wins(image, tmp_path, newer):
    store = HotStore(str(tmp_path / "hotsets"))
    dom = FakeDomain()
    old, new = [Region(0, MiB, 1.0)], [Region(32 * MiB, 2 * MiB, 2.0)]
    first, second = (("host", old), ("live", new)) if newer == "live" else (("live", old), ("host", new))
    for wall, (where, regions) in zip((1000.0, 2000.0), (first, second)):
        keeper = _stored(dom if where == "live" else FakeDomain(), store if where == "host" else HotStore(
            str(tmp_path / "elsewhere")), wall=wall)
        keeper.save([Disk("vda", image, FakeEngine(regions, 64 * MiB))], live=True)
    keeper = _stored(dom, store)
    keeper.load()
    disk = Disk("vda", image, FakeEngine([], 64 * MiB))
    keeper.warm_all([disk])
    assert keeper.source == newer and disk.engine.warm is not None and disk.engine.warm.total_bytes == 2 * MiB


def test_a_broken_host_copy_is_one_line_and_the_xml_set_is_used(image, tmp_path, caplog):
    store = HotStore(str(tmp_path / "hotsets"))
    dom = FakeDomain()
    _stored(dom, store).save([Disk("vda", image, FakeEngine([Region(0, MiB, 1.0)], 64 * MiB))], live=True)
    (tmp_path / "hotsets" / f"{UUID}.xml").write_text("<hotset version='9' saved='1'/>")
    keeper = _stored(dom, store)
    keeper.load()
    assert keeper.source == "live"
    (line,) = [r.getMessage() for r in caplog.records if "hotset.unusable" in r.getMessage()]
    assert line.startswith("hotset.unusable error=\"host: hotset version") and "the live set is used" in line


def test_a_transient_domain_gone_at_stop_keeps_the_hosts_copy(image, tmp_path):
    class Gone(FakeDomain):
        def is_persistent(self) -> bool:
            raise DomainGoneError("web-1: cannot get persistence: Domain not found")

    store = HotStore(str(tmp_path / "hotsets"))
    assert _stored(Gone(), store).save([Disk("vda", image, FakeEngine([Region(0, MiB, 1.0)], 64 * MiB))],
                                       live=False)
    assert store.load(UUID) is not None


def test_the_store_is_bounded_by_count_and_age_and_pruned_at_each_save(tmp_path):
    now = [time.time()]  # a save stamps the file with the real clock
    store = HotStore(str(tmp_path), keep=3, max_age=86400.0, clock=lambda: now[0])
    hotset = HotSet(1, (DiskHotSet("vda", "/img/a", 64 * MiB, None, MiB, (Region(0, MiB, 1.0),)),))
    uuids = [f"00000000-0000-0000-0000-{i:012d}" for i in range(5)]
    for i, uuid in enumerate(uuids[:4]):
        store.save(uuid, hotset)
        os.utime(store.path(uuid), (now[0] - 100 * (5 - i),) * 2)  # saved 500, 400, 300, 200 s ago
    (tmp_path / ".x.xml.1.abcd.tmp").write_text("half")  # a write killed half way, 2 h ago
    os.utime(tmp_path / ".x.xml.1.abcd.tmp", (now[0] - 7200,) * 2)
    store.save(uuids[4], hotset)  # now: the newest; the prune keeps it and the two next newest
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{u}.xml" for u in uuids[2:]]
    now[0] += 86400 - 250  # uuids[2] is over a day old now, uuids[3] not yet
    assert [os.path.basename(p) for p in store.prune()] == [f"{uuids[2]}.xml"]
    now[0] += 10**6
    assert store.prune(spare=store.path(uuids[4])) == [store.path(uuids[3])]  # the one just saved stays
    with pytest.raises(ConfigError):
        store.path("../../etc/passwd")


class CountingDomain(FakeDomain):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[Affect] = []

    def set_hotset(self, hotset: HotSet | None, affect: Affect = Affect.CURRENT) -> None:
        self.writes.append(affect)
        super().set_hotset(hotset, affect)


def test_follow_writes_the_live_set_when_its_regions_change_and_saves_fully_when_due(image, tmp_path):
    """What a live migration carries is the live XML: it follows the pins cycle by cycle, written only when
    the regions changed; the persistent definition and the host's copy wait for hotset_interval."""
    dom, now = CountingDomain(), [100.0]
    store = HotStore(tmp_path / "hotsets")
    keeper = HotSetKeeper(lambda: dom, every=300.0, logger=logging.getLogger("t"), clock=lambda: now[0],
                          wall=lambda: 1795430400.0 + now[0], store=store, uuid=lambda: "0e3c2a9e-8a43-4a55-9d0a-3c1c2a4f5b61")
    first = [Region(8 * MiB, 4 * MiB, 4.0)]
    engine = FakeEngine(first, 64 * MiB)
    disks = [Disk("vda", image, engine)]
    keeper.follow(disks)
    assert engine.asked == [True]  # the live set ranks what the guest reads now first (vmcache.model.saveset)
    assert dom.writes == [Affect.LIVE] and int(Affect.CONFIG) not in dom.saved and store.load("0e3c2a9e-8a43-4a55-9d0a-3c1c2a4f5b61") is None
    now[0] = 110.0
    engine._regions = [Region(8 * MiB, 4 * MiB, 9.0)]      # heat moved, the ranges did not
    keeper.follow(disks)
    assert dom.writes == [Affect.LIVE]
    engine._regions = [Region(24 * MiB, 2 * MiB, 5.0)]     # the guest moved on
    keeper.follow(disks)
    assert dom.writes == [Affect.LIVE, Affect.LIVE]
    (record,) = parse_hotset(dom.saved[int(Affect.LIVE)]).disks
    assert [(r.start, r.length) for r in record.regions] == [(24 * MiB, 2 * MiB)]
    now[0] = 400.0                                          # hotset_interval after the first cycle
    engine.now = [Region(40 * MiB, 2 * MiB, 5.0)]           # read a minute: first in what a migration carries
    keeper.follow(disks)
    # the full save: the most read for a start (persistent, host), what the guest reads now for a migration
    assert dom.writes[-2:] == [Affect.LIVE, Affect.CONFIG] and engine.asked[-2:] == [False, True]
    spans = {flag: [(r.start, r.length) for r in parse_hotset(dom.saved[int(flag)]).disks[0].regions]
             for flag in (Affect.LIVE, Affect.CONFIG)}
    assert spans == {Affect.LIVE: [(40 * MiB, 2 * MiB)], Affect.CONFIG: [(24 * MiB, 2 * MiB)]}
    assert store.load("0e3c2a9e-8a43-4a55-9d0a-3c1c2a4f5b61") is not None
    now[0] = 410.0
    keeper.follow(disks)                                    # just saved, nothing changed
    assert len(dom.writes) == 4
    engine.now = None
    engine._regions = []                                    # nothing held: the live element goes
    keeper.follow(disks)
    assert dom.writes[-1] == Affect.LIVE and int(Affect.LIVE) not in dom.saved


def test_follow_writes_nothing_once_vmcache_no_longer_manages_the_domain_or_never_saves(image):
    dom = CountingDomain()
    dom.settings_ = DomainSettings(enabled=False)
    disks = [Disk("vda", image, FakeEngine([Region(0, MiB, 1.0)], 64 * MiB))]
    keeper = _keeper(dom)
    keeper.follow(disks)
    never = HotSetKeeper(lambda: dom, every=0.0, logger=logging.getLogger("t"))
    dom.settings_ = DomainSettings()
    never.follow(disks)
    assert dom.writes == []


def test_follow_survives_libvirt_refusing_the_write(image, caplog):
    dom = CountingDomain()
    disks = [Disk("vda", image, FakeEngine([Region(0, MiB, 1.0)], 64 * MiB))]
    keeper = _keeper(dom)
    dom.fail = DomainError("Timed out during operation: cannot acquire state change lock")
    caplog.set_level(logging.INFO)
    keeper.follow(disks)                                    # a migration's job holds the domain: logged
    assert "hotset.live_save_failed" in caplog.text
    dom.fail = None
    keeper.follow(disks)                                    # and written at the next cycle
    assert int(Affect.LIVE) in dom.saved


def test_a_stopped_domains_set_goes_to_the_hosts_copy_alone_where_there_is_one(image, tmp_path):
    """What stopped the domain (a snapshot revert) may hold its job: a persistent-XML write would wait for it."""
    dom, store = CountingDomain(), HotStore(tmp_path / "hotsets")
    disks = [Disk("vda", image, FakeEngine([Region(8 * MiB, 4 * MiB, 4.0)], 64 * MiB))]
    assert _stored(dom, store).save(disks, live=False)
    assert dom.writes == [] and store.load(UUID) is not None
    assert _keeper(dom).save(disks, live=False) and dom.writes == [Affect.CONFIG]   # no host copy: the XML


def test_a_running_domain_busy_with_a_job_gets_its_set_when_the_job_is_over(image, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    dom, store = CountingDomain(), HotStore(tmp_path / "hotsets")
    dom.busy = "job type 2"                                   # a migration or a save running
    disks = [Disk("vda", image, FakeEngine([Region(8 * MiB, 4 * MiB, 4.0)], 64 * MiB))]
    keeper = _stored(dom, store)
    assert keeper.save(disks, live=True) and dom.writes == [] and store.load(UUID) is not None
    assert "hotset.xml_later" in caplog.text
    keeper.follow(disks)
    assert dom.writes == []
    dom.busy = None
    keeper.follow(disks)
    assert dom.writes == [Affect.LIVE]
