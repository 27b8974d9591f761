"""The use of vmcache's loads in the replay: were the units its pins loaded read afterwards (vmcache.replay.loads)."""

from __future__ import annotations

import numpy as np
import pytest

from vmcache.replay.accesses import BlockTrace
from vmcache.replay.loads import HORIZON, Loads, read_within
from vmcache.replay.sim import replay
from vmcache.replay.trace import Trace

MiB = 1 << 20


def trace_of(accesses: list[tuple[float, int, bool]]) -> BlockTrace:
    """Unit accesses (time, unit, write) in time order, one 4 KiB unit each."""
    time, unit, write = (np.array(x) for x in zip(*accesses))
    return BlockTrace.aligned(unit.astype(np.int64), time.astype(np.float64), write.astype(bool), 4096, 100)


def test_a_load_counts_as_read_when_a_guest_read_of_its_unit_follows_within_the_horizon() -> None:
    bt = trace_of([(5.0, 4, False),      # unit 4: read before its load only
                   (10.0, 5, False),     # unit 5: read at the load's time (the next cycle's read)
                   (12.0, 3, True),      # unit 3: written, never read
                   (15.0, 1, False),     # unit 1: read 5 s after
                   (10.0 + HORIZON + 90, 2, False),  # unit 2: read past the horizon
                   (350.0, 6, False)])   # unit 6: loaded twice, read after the second load
    times = np.array([10.0, 10.0, 10.0, 10.0, 10.0, 10.0, 300.0])
    units = np.array([1, 2, 3, 4, 5, 6, 6])
    assert read_within(bt, times, units).tolist() == [True, False, False, False, True, False, True]
    assert read_within(bt, times, units, horizon=HORIZON + 100).tolist()[1] is True
    assert read_within(bt, np.zeros(0), np.zeros(0, dtype=np.int64)).size == 0
    with pytest.raises(ValueError):
        read_within(bt, times[:2], units)


def test_loads_keep_each_cycles_units_with_its_time() -> None:
    loads = Loads()
    assert len(loads) == 0 and loads.arrays()[1].size == 0
    loads.add(10.0, [3, 1])
    loads.add(20.0, [])
    loads.add(30.0, [1])
    times, units = loads.arrays()
    assert len(loads) == 3 and times.tolist() == [10.0, 10.0, 30.0] and units.tolist() == [3, 1, 1]
    bt = trace_of([(31.0, 1, False), (40.0, 3, False)])
    # unit 1 was loaded again before its read: only the second load was used
    assert loads.used(bt).tolist() == [True, False, True]


def _blocks_read(pages: int, size: int, count: int, seed: int) -> Trace:
    """4 KiB reads at random over the first ``pages`` pages of each 64 KiB block of ``size`` bytes."""
    rng = np.random.default_rng(seed)
    block = rng.integers(0, size // (64 << 10), count)
    offset = block * (64 << 10) + rng.integers(0, pages, count) * 4096
    return Trace(np.arange(count) / 50.0, np.zeros(count, dtype=bool), offset.astype(np.int64),
                 np.full(count, 4096, dtype=np.int64))


def test_the_replay_reports_how_much_of_what_the_pins_loaded_the_guest_read() -> None:
    """Pins fill the 64 KiB blocks the guest spreads through (used); not those it reads one page of (the load gate)."""
    size = 4 * MiB
    broad, narrow = _blocks_read(16, size, 20000, 1), _blocks_read(1, size, 20000, 1)
    runs = {}
    for name, trace in (("broad", broad), ("narrow", narrow)):
        (r,) = replay(trace, [8 * MiB], block_size=64 << 10, cache_unit=4096, policies=("vmcache",), size_bytes=size)
        assert r.extra["loaded_units"] == r.extra["prefetched_blocks"], name
        assert r.extra["loaded_per_request"] == round(r.extra["loaded_units"] / r.requests, 6)
        runs[name] = r.extra
    assert runs["broad"]["loaded_units"] > 0 and runs["broad"]["loaded_read_share"] > 0.9
    assert runs["narrow"]["loaded_units"] == 0 and runs["narrow"]["loaded_read_share"] == 0.0
    (lru,) = replay(broad, [8 * MiB], block_size=64 << 10, cache_unit=4096, policies=("lru",), size_bytes=size)
    assert "loaded_read_share" not in lru.extra


def test_host_mode_reports_the_use_of_each_vms_loads() -> None:
    from vmcache.replay.host import HostVm, replay_host

    size = 4 * MiB
    vms = [HostVm("broad", _blocks_read(16, size, 20000, 1), 8 * MiB, size_bytes=size),
           HostVm("narrow", _blocks_read(1, size, 20000, 2), 8 * MiB, size_bytes=size)]
    by_arm = {r.arm: r for r in replay_host(vms, [4 * MiB], block_size=64 << 10, cache_unit=4096, memory=16 * MiB)}
    equal = by_arm["equal"]
    assert equal.vms["broad"].extra["loaded_read_share"] > 0.9
    assert equal.vms["narrow"].extra["loaded_units"] == 0 or equal.vms["narrow"].extra["loaded_read_share"] == 0.0
    used = sum(v.extra["loaded_read_share"] * v.extra["loaded_units"] for v in equal.vms.values())
    assert equal.total.extra["loaded_read_share"] == pytest.approx(used / equal.total.extra["loaded_units"], abs=1e-5)


def test_pins_that_fill_only_what_is_cached_load_nothing_and_keep_hits() -> None:
    """``fill: cached``: the same plans, no loads; the blocks the guest spreads through are pinned as it reads them."""
    size = 4 * MiB
    broad = _blocks_read(16, size, 20000, 1)
    results = {}
    for fill in (True, False):
        (r,) = replay(broad, [8 * MiB], block_size=64 << 10, cache_unit=4096, policies=("inferred",), size_bytes=size,
                      fill=fill)
        results[fill] = r
    assert results[True].extra["loaded_units"] > 0
    assert results[False].extra["loaded_units"] == 0
    assert results[False].extra["pinned_blocks_mean"] > 0
    (linux,) = replay(broad, [8 * MiB], block_size=64 << 10, cache_unit=4096, policies=("linux",), size_bytes=size)
    # no neighbour here: what the pins hold the kernel's lists hold too, and nothing is read ahead
    assert results[False].device_reads == linux.device_reads
    assert results[True].device_reads < linux.device_reads  # the loads took misses off the guest


def test_host_mode_pins_that_fill_only_what_is_cached_load_nothing() -> None:
    from vmcache.replay.host import HostVm, replay_host

    size = 4 * MiB
    vms = [HostVm("broad", _blocks_read(16, size, 20000, 1), 8 * MiB, size_bytes=size),
           HostVm("other", _blocks_read(16, size, 20000, 2), 8 * MiB, size_bytes=size)]
    for fill, loads in ((True, True), (False, False)):
        results = replay_host(vms, [4 * MiB], block_size=64 << 10, cache_unit=4096, memory=16 * MiB, fill=fill)
        assert sum("loaded_units" in r.total.extra for r in results) >= 4  # the splits
        assert all((r.total.extra["loaded_units"] > 0) == loads for r in results if "loaded_units" in r.total.extra)
