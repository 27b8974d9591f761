"""The replay's second runs: vmcache's warm start against a snapshot restore and the most-read set."""

from __future__ import annotations

import numpy as np
import pytest

from vmcache.replay import generate, restore, sim
from vmcache.replay.accesses import BlockTrace
from vmcache.replay.baselines import LinuxCache, LruCache

MiB = 1 << 20


def test_the_warm_start_restores_what_the_guest_read_most_where_the_kernel_held_it_and_pins_were_few() -> None:
    """A zoned guest whose zones the kernel's cache holds: the pin share leaves them to it and pins little
    (a set of the pins saved 2 blocks here and gained 7% over the first minute); the set of the blocks the
    guest read most fills the pin budget, and the second run's first minute reads the device far less."""
    trace = generate.zoned(256 * MiB, 20_000, seed=4, rate=100.0)
    cold, warm, snapshot, most = sim.replay(trace, [96 * MiB], block_size=MiB, cache_unit=4096, pin_share=0.5,
                                            policies=("vmcache", "warm", "snapshot", "most-read"), head=60.0)
    assert warm.extra["warm_saved_blocks"] == 48  # the whole pin budget: 48 MiB of the 96
    assert warm.extra["warm_restored_blocks"] == 48
    assert warm.extra["head_reads_per_request"] < 0.3 * cold.extra["head_reads_per_request"], (warm.extra, cold.extra)
    for arm in (snapshot, most):  # restores of the whole memory, before the first access
        assert 0 < arm.extra["restored_units"] <= 96 * MiB // 4096
        assert arm.extra["head_reads_per_request"] < cold.extra["head_reads_per_request"]
        assert arm.extra["loaded_units"] >= arm.extra["restored_units"]


def _reads(units: list[int]) -> BlockTrace:
    block = np.asarray(units, dtype=np.int64)
    n = block.size
    return BlockTrace.aligned(block, np.arange(n, dtype=np.float64), np.zeros(n, dtype=bool), 4096, 100)


def test_most_read_takes_the_units_read_most_the_most_read_last() -> None:
    bt = _reads([5, 5, 5, 2, 2, 9, 7, 7, 7, 7])
    assert restore.most_read(bt, 3).tolist() == [2, 5, 7]
    assert restore.most_read(bt, 0).tolist() == []
    resident = np.array([1, 2, 3], dtype=np.int64)
    assert restore.restored_units("snapshot", bt, 2, resident).tolist() == [2, 3]
    with pytest.raises(ValueError):
        restore.restored_units("other", bt, 2, resident)


@pytest.mark.parametrize("cache", [LinuxCache(3), LruCache(3)], ids=["linux", "lru"])
def test_a_preload_reads_what_is_not_cached_and_keeps_the_latest_within_the_room(cache: LinuxCache | LruCache
                                                                                 ) -> None:
    cache.access(1, False)
    assert restore.preload(cache, np.array([1, 4, 5, 6], dtype=np.int64)) == [4, 5, 6]
    assert sorted(cache) == [4, 5, 6]
    assert cache.access(6, False)  # a hit: the restore read it


def test_warm_heat_restores_the_same_set_in_heat_order() -> None:
    """The two orders side by side: the same saved set, restored whole by both at 2 MiB a cycle."""
    trace = generate.zoned(256 * MiB, 20_000, seed=4, rate=100.0)
    warm, heat = sim.replay(trace, [96 * MiB], block_size=MiB, cache_unit=4096, pin_share=0.5, head=60.0,
                            policies=("warm", "warm-heat"), prefetch_rate=MiB // 10, warm_rate=2 * MiB // 10)
    assert warm.extra["warm_saved_blocks"] == heat.extra["warm_saved_blocks"] == 48
    assert warm.extra["warm_restored_blocks"] == heat.extra["warm_restored_blocks"] == 48
