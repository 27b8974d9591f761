"""Reads judged against the guest's own read rate (``miss_contrast``): a slow guest's hot set is learnt, noise is not.

A page-level guest over a 2 GiB disk of 1 MiB blocks (as on a host: the
cycle sees the resident share of each block) drives :class:`Cycle` once per
10 s cycle, with the default parameters. The hot zone is 205 MiB taking 90%
of the reads, as in the end-to-end benchmark's zoned workload.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from vmcache.errors import ConfigError
from vmcache.model.blocks import blocks_mask
from vmcache.model.cycle import Cycle
from vmcache.model.params import ModelParams
from vmcache.model.region import Region
from vmcache.replay import generate, sim

MiB = 1 << 20
PAGES = 256  # per 1 MiB block
NBLOCKS = 2048
HOT = slice(600, 805)  # 205 blocks
BUDGET = 256 * MiB
P = ModelParams(block_size=MiB, interval=10.0)


class Guest:
    """Pages resident in the host's cache (no eviction unless ``forget``), the reads of one cycle at a time."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.resident = np.zeros(NBLOCKS * PAGES, dtype=bool)

    def zoned(self, reads: int) -> np.ndarray:
        """``reads`` random 4 KiB reads, 90% in the hot zone; the pages read."""
        hot = self.rng.random(reads) < 0.9
        inside = self.rng.integers(HOT.start * PAGES, HOT.stop * PAGES, size=reads)
        anywhere = self.rng.integers(0, NBLOCKS * PAGES, size=reads)
        pages = np.where(hot, inside, anywhere)
        self.resident[pages] = True
        return pages

    def residency(self) -> np.ndarray:
        return (self.resident.reshape(NBLOCKS, PAGES).sum(axis=1) / PAGES).astype(np.float32)


def run(cycle: Cycle, guest: Guest, reads: int, cycles: int) -> list[list[Region]]:
    """``cycles`` cycles of a zoned guest reading ``reads`` pages per cycle, nothing pinned; the plans."""
    zeros = np.zeros(NBLOCKS, np.float32)
    plans = []
    for k in range(cycles):
        guest.zoned(reads)
        plans.append(cycle.step(guest.residency(), zeros, [], size_bytes=NBLOCKS * MiB, budget=BUDGET,
                                now=10.0 * (k + 1)).regions)
    return plans


def covered(regions: list[Region]) -> tuple[int, int]:
    """Blocks of the hot zone planned, blocks planned outside it."""
    mask = blocks_mask(regions, MiB, NBLOCKS)
    return int(mask[HOT].sum()), int(mask.sum() - mask[HOT].sum())


@pytest.mark.parametrize("reads, within", [(200, 9), (1500, 6)])  # 20 and 150 reads per second
def test_a_slow_guests_hot_zone_is_planned_within_a_few_cycles(reads: int, within: int) -> None:
    """The first cycle has nothing to compare with; then ~9/12 of full input per cycle, 0.1 of it kept. A block
    is filled after three new peaks (the load gate): at 20 reads a second a block gains a page in ~63% of cycles."""
    plans = run(Cycle(P, NBLOCKS), Guest(1), reads, within)
    hot, outside = covered(plans[-1])
    assert hot >= 0.9 * 205 and outside <= 8  # the zone, give or take the merge gap at its edges


@pytest.mark.parametrize("reads", [200, 1500])
def test_without_it_a_slow_guest_shows_nothing(reads: int) -> None:
    """The failure the end-to-end hdd arm showed: after 8 cycles no block crossed the threshold."""
    plans = run(Cycle(replace(P, miss_contrast=0.0), NBLOCKS), Guest(1), reads, 8)
    assert plans[-1] == []


def test_reads_spread_evenly_are_not_hot() -> None:
    """A fast guest reading the whole disk uniformly (2000 pages per cycle): nothing stands out."""
    cycle = Cycle(P, NBLOCKS)
    rng = np.random.default_rng(3)
    resident = np.zeros(NBLOCKS * PAGES, dtype=bool)
    zeros = np.zeros(NBLOCKS, np.float32)
    for k in range(60):
        if k % 6 == 0:
            resident[:] = False  # the kernel reclaims now and then
        resident[rng.integers(0, NBLOCKS * PAGES, size=2000)] = True
        residency = (resident.reshape(NBLOCKS, PAGES).sum(axis=1) / PAGES).astype(np.float32)
        regions = cycle.step(residency, zeros, [], size_bytes=NBLOCKS * MiB, budget=BUDGET, now=10.0 * (k + 1))
        assert regions.regions == [], k


@pytest.mark.parametrize("blocks_per_cycle", [2, 20, 200])
def test_a_one_pass_stream_is_not_hot(blocks_per_cycle: int) -> None:
    """A sequential read of the disk, once, its pages dropped a cycle after they were read (use-once)."""
    cycle = Cycle(P, NBLOCKS)
    zeros = np.zeros(NBLOCKS, np.float32)
    done = 0
    for k in range(NBLOCKS // blocks_per_cycle):
        residency = zeros.copy()
        residency[done : done + blocks_per_cycle] = 1.0  # read in full this cycle; the previous ones evicted
        done += blocks_per_cycle
        result = cycle.step(residency, zeros, [], size_bytes=NBLOCKS * MiB, budget=BUDGET, now=10.0 * (k + 1))
        assert result.regions == [], k
        if k > 40:
            break


def test_miss_contrast_is_validated() -> None:
    assert ModelParams(miss_contrast=0).miss_contrast == 0.0
    assert ModelParams.from_mapping({"miss_contrast": 4}).miss_contrast == 4.0
    for bad in (0.5, -1, float("nan"), "x"):
        with pytest.raises(ConfigError, match="miss_contrast"):
            ModelParams.from_mapping({"miss_contrast": bad})


def test_replay_of_a_slow_zoned_guest_page_by_page() -> None:
    """The replay with 4 KiB cache units (the model sees resident shares): 20 reads/s over 2 GiB, 400 s."""
    trace = generate.zoned(2048 * MiB, 8000, seed=1, rate=20.0)

    def ratios(params: ModelParams) -> dict[str, float]:
        rows = sim.replay(trace, [512 * MiB], block_size=MiB, params=params, pin_share=0.5, size_bytes=2048 * MiB,
                          policies=("inferred", "lru"), cache_unit=4096, rest="lru")
        return {r.policy: r.hit_ratio for r in rows}

    now, before = ratios(P), ratios(replace(P, miss_contrast=0.0))
    assert before["inferred"] < before["lru"] + 0.05  # nothing learnt: the kernel's own caching
    assert now["inferred"] > 0.5 > 0.15 > now["lru"]


def test_replay_cache_unit_must_divide_the_block() -> None:
    trace = generate.zoned(64 * MiB, 100, seed=1)
    with pytest.raises(ValueError, match="cache unit"):
        sim.replay(trace, [8 * MiB], block_size=MiB, cache_unit=3 * 4096)
