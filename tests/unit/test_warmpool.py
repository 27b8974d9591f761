"""The host's warm-up budget: who goes first (model/warmshare.py) and the shared bucket (host/warmpool.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from vmcache.host.warmpool import WarmPool
from vmcache.model.blocks import BlockValues
from vmcache.model.params import ModelParams
from vmcache.model.prefetch import PrefetchBucket
from vmcache.model.region import Region
from vmcache.model.warmshare import WarmAsk, warm_grant

MiB = 1 << 20


def test_the_densest_ask_goes_first_ties_by_name_and_stale_asks_hold_nothing_back() -> None:
    asks = {"a": WarmAsk(100, 0.5, 10.0), "b": WarmAsk(100, 0.9, 10.0), "c": WarmAsk(100, 0.5, 10.0)}
    assert warm_grant(150, asks, "b", 10.0, fresh=20) == 100          # densest: all it wants
    assert warm_grant(150, asks, "a", 10.0, fresh=20) == 50           # after b
    assert warm_grant(150, asks, "c", 10.0, fresh=20) == 0            # after b and a (same density, name)
    asks["b"] = WarmAsk(100, 0.9, -15.0)                              # b's agent stopped asking 25 s ago
    assert warm_grant(150, asks, "a", 10.0, fresh=20) == 100


def pool(tmp_path: Path, now: list[float]) -> WarmPool:
    return WarmPool(str(tmp_path / "run" / "warmup.json"), 10 * MiB, burst=10.0, clock=lambda: now[0])


def test_agents_share_one_bucket_per_device_filled_at_the_rate_and_holding_one_burst(tmp_path: Path) -> None:
    now = [1000.0]
    a, b = pool(tmp_path, now), pool(tmp_path, now)                  # two agents, one file
    assert a.take("254:0", "/img/a", 80 * MiB, 0.5) == 80 * MiB       # a full bucket: 100 MiB
    assert b.take("254:0", "/img/b", 80 * MiB, 0.6) == 20 * MiB       # what is left
    assert b.take("8:16", "/img/c", 80 * MiB, 0.5) == 80 * MiB        # another device, another budget
    now[0] += 3.0
    assert a.take("254:0", "/img/a", 80 * MiB, 0.5) == 0              # 30 MiB back, but b (denser, waiting) first
    assert b.take("254:0", "/img/b", 60 * MiB, 0.6) == 30 * MiB
    now[0] += 1000.0                                                  # never more than one burst saved up
    assert a.take("254:0", "/img/a", 500 * MiB, 0.9) == 100 * MiB
    a.give_back("254:0", "/img/a", 40 * MiB)                          # not read: back, a waits no more
    assert b.take("254:0", "/img/b", 60 * MiB, 0.1) == 40 * MiB


def test_a_disk_done_restoring_is_forgotten_and_a_damaged_file_starts_full(tmp_path: Path) -> None:
    now = [0.0]
    p = pool(tmp_path, now)
    p.take("254:0", "/img/a", 200 * MiB, 0.9)                         # waits for 100 MiB more
    assert p.take("254:0", "/img/b", 10 * MiB, 0.1) == 0
    p.forget("/img/a")
    now[0] += 1.0
    assert p.take("254:0", "/img/b", 10 * MiB, 0.1) == 10 * MiB
    Path(p.path).write_text("{not json")
    assert p.take("254:0", "/img/b", 10 * MiB, 0.1) == 10 * MiB
    assert json.loads(Path(p.path).read_text())["version"] == 1


def test_the_bucket_pays_a_restore_from_the_allowance_alone_and_leaves_what_it_did_not_need() -> None:
    params = ModelParams(block_size=MiB, interval=8.0)
    bucket = PrefetchBucket(params, prefetch_rate=MiB // 8, warm_rate=32 * MiB)   # 1 MiB a cycle of its own
    cold = BlockValues(np.zeros(0, np.int64), np.zeros(0, np.float32))
    regions = [Region(0, 8 * MiB, 9.0)]
    kept, waiting = bucket.limit(regions, cold, [], 64 * MiB, 0.0, restoring=True, allowance=3 * MiB)
    assert kept == [Region(0, 3 * MiB, 9.0)] and waiting == 1 and bucket.unspent == 0     # the grant's 3 MiB
    kept, waiting = bucket.limit([Region(0, 2 * MiB, 9.0)], cold, [], 64 * MiB, 8.0, restoring=True,
                                 allowance=8 * MiB)
    assert kept == [Region(0, 2 * MiB, 9.0)] and bucket.unspent == 6 * MiB


def test_a_restore_reads_no_more_than_the_host_grants_and_the_guests_own_new_pins_keep_their_tokens() -> None:
    """Twenty disks restoring at once read what the host's budget grants them, not that plus twenty
    prefetch rates; a block the guest made hot meanwhile is paid from the disk's own tokens."""
    params = ModelParams(block_size=MiB, interval=8.0)
    bucket = PrefetchBucket(params, prefetch_rate=MiB // 2, warm_rate=32 * MiB)   # 4 MiB a cycle of its own
    cold = BlockValues(np.zeros(0, np.int64), np.zeros(0, np.float32))
    saved = [Region(0, 64 * MiB, 9.0)]
    hot = Region(100 * MiB, 2 * MiB, 5.0)
    kept, waiting = bucket.limit([*saved, hot], cold, [], 256 * MiB, 0.0, restoring=True, allowance=0, saved=saved)
    assert kept == [hot] and waiting == 1                                      # no grant: the set waits
    kept, _ = bucket.limit([*saved, hot], cold, [hot], 256 * MiB, 8.0, restoring=True, allowance=5 * MiB,
                           saved=saved)
    assert kept == [Region(0, 5 * MiB, 9.0), hot] and bucket.unspent == 0


def test_a_killed_agents_asks_go_with_its_domain_and_no_one_elses(tmp_path: Path) -> None:
    now = [0.0]
    p = pool(tmp_path, now)
    p.take("254:0", "/img/a", 200 * MiB, 0.9, owner="web-1")
    p.take("254:0", "/img/b", 200 * MiB, 0.1, owner="web-2")
    assert p.forget_owner("web-1") == ["/img/a"]
    assert p.forget_owner("web-1") == []
    doc = json.loads(Path(p.path).read_text())["devices"]["254:0"]["asks"]
    assert set(doc) == {"/img/b"} and doc["/img/b"]["owner"] == "web-2"
    assert WarmPool(str(tmp_path / "none.json"), MiB, burst=1.0).forget_owner("web-1") == []   # nothing made
    assert not (tmp_path / "none.json").exists()


def test_a_disk_asks_one_interval_of_the_rate_at_most_what_is_left_at_its_next_regions_density() -> None:
    from vmcache.model.warm import WarmStart
    from vmcache.model.warmshare import warm_ask

    params = ModelParams(block_size=MiB, interval=10.0)
    warm = WarmStart([(Region(0, 4 * MiB, 1.0), 0.25), (Region(8 * MiB, 2 * MiB, 1.5), 0.75)], params)
    assert warm_ask(warm, params, MiB // 4) == (int(2.5 * MiB), 0.75 / params.read_amplitude)  # 2 x 0.75 > 4 x 0.25
    assert warm_ask(warm, params, MiB) == (6 * MiB, 0.75 / params.read_amplitude)             # no more than the set
    assert warm_ask(None, params, MiB) is None
    warm.update(np.arange(0, 10, dtype=np.int64))
    assert warm.done and warm_ask(warm, params, MiB) is None


def test_one_device_budget_serves_the_densest_waiting_ask_first_and_forgets_a_silent_one() -> None:
    from vmcache.model.warmshare import DeviceBudget

    rate, burst = 10 * MiB, 10.0
    dev = DeviceBudget.full(rate, burst, 0.0)                          # 100 MiB
    assert dev.take("a", 150 * MiB, 0.2, 0.0, rate=rate, burst=burst) == 100 * MiB
    assert dev.asks["a"].want == 50 * MiB                               # still asked for
    assert dev.take("b", 30 * MiB, 0.1, 5.0, rate=rate, burst=burst) == 0   # 50 MiB back, a (denser) waits for it
    assert dev.take("a", 50 * MiB, 0.2, 5.0, rate=rate, burst=burst) == 50 * MiB and "a" not in dev.asks
    dev.give_back("a", 20 * MiB, rate=rate, burst=burst)
    assert dev.tokens == 20 * MiB
    dev.take("c", 500 * MiB, 0.9, 5.0, rate=rate, burst=burst)         # c waits for 480 MiB ...
    assert dev.take("b", 30 * MiB, 0.1, 10.0, rate=rate, burst=burst) == 0
    assert dev.take("b", 30 * MiB, 0.1, 26.0, rate=rate, burst=burst) == 30 * MiB   # ... until it went silent
    assert "c" not in dev.asks
