"""The saved hot set: encoding round trip, size bound, image identity, hostile input; warm start seeding."""

from __future__ import annotations

import base64
import random
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vmcache.errors import ConfigError
from vmcache.model.heat import HeatModel
from vmcache.model.params import ModelParams
from vmcache.model.region import Region
from vmcache.model.warm import WarmStart
from vmcache.settings.hotset import (
    HOTSET_NAMESPACE,
    MAX_REGIONS,
    MAX_TEXT,
    DiskHotSet,
    HotSet,
    build_hotset,
    hotset_of,
    mismatch,
    parse_hotset,
)
from vmcache.settings.metadata import NAMESPACE, parse_domain

MiB = 1 << 20
TiB = 1 << 40


def _spread(count: int, size: int, bs: int, seed: int = 1) -> tuple[Region, ...]:
    """``count`` disjoint regions of 1-16 blocks spread over ``size`` bytes, heat 0.2-3 per block."""
    rng = random.Random(seed)
    slots = size // bs // count
    regions = []
    for i in range(count):
        blocks = rng.randint(1, 16)
        first = i * slots + rng.randint(0, slots - blocks)
        regions.append(Region(first * bs, blocks * bs, rng.uniform(0.2, 3.0) * blocks))
    return tuple(regions)


def _record(regions: tuple[Region, ...], size: int = TiB, bs: int = MiB) -> DiskHotSet:
    return DiskHotSet("vda", "/var/lib/libvirt/images/web-1.img", size, "0123456789abcdef", bs, regions)


def test_round_trip_keeps_regions_and_heat_to_a_256th():
    record = _record(_spread(300, TiB, MiB))
    back = parse_hotset(build_hotset(HotSet(saved=1795430400, disks=(record,))))
    assert back.saved == 1795430400
    (disk,) = back.disks
    assert (disk.dev, disk.image, disk.size, disk.image_id, disk.block_size) == (
        "vda", record.image, TiB, record.image_id, MiB)
    assert sorted(r.span for r in disk.regions) == sorted(r.span for r in record.regions)
    saved = {r.span: record.mean_heat(r) for r in record.regions}
    for region in disk.regions:
        assert abs(disk.mean_heat(region) - saved[region.span]) <= 0.5 / 256 + 1e-9
    priorities = [r.priority for r in disk.regions]
    assert priorities == sorted(priorities, reverse=True)  # highest first: the restore order


def test_1024_regions_of_a_1tib_disk_fit_in_a_few_kb():
    regions = _spread(MAX_REGIONS, TiB, MiB)
    first = tuple(random.Random(3).randint(1, 8640) for _ in regions)  # first read within a day of 10 s cycles
    text = build_hotset(HotSet(saved=1, disks=(replace(_record(regions), first=first),)))
    assert len(text) < 10 * 1024, len(text)  # the bound docs/metadata.md states
    assert len(parse_hotset(text).disks[0].regions) == MAX_REGIONS


def test_each_region_keeps_its_first_read_cycle_and_a_version_1_set_loads_without_an_order():
    regions = _spread(MAX_REGIONS + 50, TiB, MiB)
    first = tuple(range(1, len(regions) + 1))
    (disk,) = parse_hotset(build_hotset(HotSet(saved=1, disks=(replace(_record(regions), first=first),)))).disks
    assert len(disk.first) == len(disk.regions) == MAX_REGIONS  # cut with the regions it belongs to
    saved = dict(zip((r.span for r in regions), first))
    assert disk.order() == {r.span: saved[r.span] for r in disk.regions}
    (none,) = parse_hotset(build_hotset(HotSet(saved=1, disks=(_record(regions[:3]),)))).disks
    assert none.first == ()  # written without an order (0 each: not read since the start), read without one
    # what a vmcache before the order wrote: three numbers a region, version 1
    old = base64.b64encode(bytes([2, 3, 51, 1, 1, 128, 2])).decode()  # blocks 2-4 heat 0.2, 6 heat 1.0
    (v1,) = parse_hotset(_element('dev="vda" image="/i" size="16777216" block="1048576"', old)).disks
    assert [r.span for r in v1.regions] == [(6 * MiB, MiB), (2 * MiB, 3 * MiB)] and v1.first == ()
    assert v1.order() == {}


def test_only_the_highest_priority_regions_are_kept():
    regions = _spread(MAX_REGIONS + 200, TiB, MiB)
    (disk,) = parse_hotset(build_hotset(HotSet(saved=1, disks=(_record(regions),)))).disks
    assert len(disk.regions) == MAX_REGIONS
    kept = {r.span for r in disk.regions}
    lowest_kept = min(r.priority for r in regions if r.span in kept)
    assert all(r.priority <= lowest_kept + 1e-9 for r in regions if r.span not in kept)


def test_last_region_is_clipped_to_the_image():
    size = 10 * MiB + 5000  # not a whole block, not a whole page
    record = _record((Region(10 * MiB, 8192, 0.5),), size=size)
    (disk,) = parse_hotset(build_hotset(HotSet(saved=1, disks=(record,)))).disks
    assert disk.regions[0].span == (10 * MiB, 8192)


def test_domain_xml_with_the_element_next_to_the_settings():
    element = build_hotset(HotSet(saved=7, disks=(_record(_spread(4, TiB, MiB)),)))
    body = element.replace("<hotset ", f'<vmcachehot:hotset xmlns:vmcachehot="{HOTSET_NAMESPACE}" ', 1)
    body = body.replace("<disk ", "<vmcachehot:disk ").replace("</disk>", "</vmcachehot:disk>")
    body = body.replace("</hotset>", "</vmcachehot:hotset>")
    xml = (f"<domain><name>web-1</name><metadata><vmcache:cache xmlns:vmcache='{NAMESPACE}' budget='1G'/>"
           f"{body}</metadata><devices/></domain>")
    assert hotset_of(xml).saved == 7
    assert parse_domain(xml).settings.budget == 1 << 30  # the opt-in element is read as before
    assert hotset_of("<domain><name>x</name><metadata/></domain>") is None


def test_identity_decides_whether_a_record_applies():
    record = _record(())
    same = dict(dev="vda", image=record.image, size=TiB, image_id=record.image_id)
    assert mismatch(record, **same) is None
    assert "disk vda, not vdb" in mismatch(record, **{**same, "dev": "vdb"})
    assert "now /other" in mismatch(record, **{**same, "image": "/other"})
    assert "bytes" in mismatch(record, **{**same, "size": TiB + MiB})  # resized
    assert "replaced" in mismatch(record, **{**same, "image_id": None})  # a new file, no id
    assert "replaced" in mismatch(record, **{**same, "image_id": "ffffffffffffffff"})
    anonymous = DiskHotSet("vda", record.image, TiB, None, MiB, ())  # saved where no id could be kept
    assert mismatch(anonymous, **same) is None


def _element(disk_attrs: str = 'dev="vda" image="/i" size="1048576" block="4096"', text: str = "",
             root_attrs: str = 'version="1" saved="1"') -> str:
    return f"<hotset {root_attrs}><disk {disk_attrs}>{text}</disk></hotset>"


@pytest.mark.parametrize("xml, words", [
    (_element(root_attrs='version="3" saved="1"'), "version"),
    (_element(root_attrs='saved="1"'), "version"),
    (_element(root_attrs='version="1" saved="-1"'), "saved"),
    (_element('dev="vda;rm" image="/i" size="1" block="4096"'), "dev"),
    (_element('dev="vda" image="relative" size="1" block="4096"'), "absolute"),
    (_element('dev="vda" image="/i" size="1" block="4097"'), "block"),
    (_element('dev="vda" image="/i" size="0" block="4096"'), "size"),
    (_element('dev="vda" image="/i" size="1" block="4096" id="XYZ"'), "id"),
    (_element('dev="vda" image="/i" size="1" block="4096" evil="1"'), "unknown attribute"),
    (_element(text="!!notbase64"), "base64"),
    (_element(text=base64.b64encode(bytes([1, 2])).decode()), "groups of 3"),
    (_element(text=base64.b64encode(bytes([1, 2, 3])).decode(), root_attrs='version="2" saved="1"'), "groups of 4"),
    (_element(text=base64.b64encode(bytes([0x80] * 12)).decode()), "number"),
    (_element(text=base64.b64encode(bytes([0, 0, 5])).decode()), "empty"),
    (_element(text=base64.b64encode(bytes([0xff, 0x7f, 1, 5])).decode()), "past the end"),
    ("<hotset version='1' saved='1'><disk dev='vda' image='/i' size='1' block='4096'/>"
     "<disk dev='vda' image='/i' size='1' block='4096'/></hotset>", "twice"),
    ("<hotset version='1' saved='1'><other/></hotset>", "unknown element"),
    ("<cache/>", "root element"),
    ("<!DOCTYPE x [<!ENTITY a 'aaaa'>]><hotset version='1' saved='1'>&a;</hotset>", "not acceptable XML"),
    ("<hotset version='1' saved='1'>" + "<disk/>" * 20000 + "</hotset>", "larger than"),
])
def test_hostile_or_broken_element_is_one_line_error(xml, words):
    with pytest.raises(ConfigError) as caught:
        parse_hotset(xml)
    message = str(caught.value)
    assert words in message and "\n" not in message


def test_too_many_regions_refused():
    values = bytes([0, 1, 5]) * (MAX_REGIONS + 1)
    with pytest.raises(ConfigError, match="more than 1024 regions"):
        parse_hotset(_element('dev="vda" image="/i" size="1099511627776" block="4096"',
                              base64.b64encode(values).decode()))


def test_oversized_element_in_a_domain_is_refused_before_its_regions_are_read():
    huge = "A" * (MAX_TEXT + 10)
    xml = (f"<domain><name>x</name><metadata><h:hotset xmlns:h='{HOTSET_NAMESPACE}' version='1' saved='1'>"
           f"<h:disk dev='vda' image='/i' size='1' block='4096'>{huge}</h:disk></h:hotset></metadata></domain>")
    with pytest.raises(ConfigError, match="larger than"):
        hotset_of(xml)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300) | st.binary(max_size=300))
def test_any_input_is_a_hotset_or_a_config_error(data):
    for xml in (data, _element(text=data if isinstance(data, str) else base64.b64encode(data).decode())):
        try:
            parse_hotset(xml)
        except ConfigError:
            pass


# -- warm start ---------------------------------------------------------------------

P = ModelParams(block_size=MiB, interval=10.0)


def test_seed_holds_a_waiting_region_and_releases_it_once_restored():
    model = HeatModel(P, 100)
    warm = WarmStart([(Region(10 * MiB, 4 * MiB, 0.0), 1.0), (Region(50 * MiB, 2 * MiB, 0.0), 0.5)], P)
    assert warm.total_bytes == 6 * MiB
    cold = np.zeros(100, dtype=np.float32)
    nothing = np.zeros(100, dtype=bool)
    for k in range(20):  # the guest reads nothing: plain decay would lose the seed in ~15 steps
        model.step(cold, cold, nothing, 10.0 * (k + 1))
        warm.seed(model, 10.0 * (k + 1))
    assert model.heat[10:14].min() == pytest.approx(1.0 * 0.98 ** 19, rel=1e-5)
    assert model.own[10:14].min() == pytest.approx(1.0 * 0.98 ** 19, rel=1e-5)
    assert model.heat[:8].max() < 0.01 and model.heat[20:48].max() < 0.01
    assert warm.update(np.arange(10, 14)) == 4 * MiB and not warm.done
    assert warm.restored_bytes == 4 * MiB and warm.pending_bytes == 2 * MiB
    for k in range(20, 90):  # restored: left to the model, it decays like any other region
        model.step(cold, cold, nothing, 10.0 * (k + 1))
        warm.seed(model, 10.0 * (k + 1))
    assert model.heat[10:14].max() < P.threshold
    # 0.5 held at 0.98 a step fell under threshold / keep_factor (0.1) after 80 steps: given up
    assert warm.done and warm.given_up_bytes == 2 * MiB


def test_a_saved_region_counts_as_held_so_its_hysteresis_applies():
    from vmcache.model.planner import plan

    model = HeatModel(P, 100)
    # held by hysteresis when saved: under the threshold (0.2), over threshold / keep_factor (0.1)
    warm = WarmStart([(Region(10 * MiB, 4 * MiB, 0.0), 0.15)], P)
    cold = np.zeros(100, dtype=np.float32)
    model.step(cold, cold, np.zeros(100, dtype=bool), 10.0)
    warm.seed(model, 10.0)
    assert plan(model.heat, params=P, size_bytes=100 * MiB, budget=64 * MiB, own=model.own) == []
    (region,) = plan(model.heat, params=P, size_bytes=100 * MiB, budget=64 * MiB, current=warm.held(),
                     own=model.own)
    assert region.span == (10 * MiB, 4 * MiB)
