"""The benches' rounds: arms interleaved in an order rotated from round to round, no arm always first."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from bench.order import round_order


def test_over_n_rounds_every_arm_runs_once_a_round_and_takes_every_place_once() -> None:
    arms = ["kernel", "vmcache", "oracle", "partition"]
    orders = [round_order(arms, r) for r in range(1, 9)]
    assert orders[0] == arms                      # round 1 runs the selection as given
    assert orders[1] == ["vmcache", "oracle", "partition", "kernel"]
    assert all(sorted(o) == sorted(arms) for o in orders)
    for place in range(len(arms)):                # rounds 1-4: each arm once in each place
        assert sorted(o[place] for o in orders[:4]) == sorted(arms)
    assert orders[4:] == orders[:4]               # and again from round 5
    assert round_order([], 3) == [] and round_order(["one"], 2) == ["one"]


def test_e2e_rounds_rotate_the_arms_and_learn_the_warm_set_once_before_the_first_round(tmp_path, monkeypatch) -> None:
    import bench.e2e
    from bench.e2e_arms import Arm, every_arm
    from bench.e2e_plan import ArmResult, Settings

    calls: list[tuple[str, int]] = []

    @contextlib.contextmanager
    def no_lock() -> Iterator[None]:
        yield

    def learn(device: str, s: Settings) -> str:
        calls.append((f"learn {device}", 0))
        return "<hotset/>"

    def run_arm(arm: Arm, s: Settings, round_: int) -> ArmResult:
        assert s.hotset == "<hotset/>"            # the warm arms start from the set learnt before
        calls.append((arm.name, round_))
        return ArmResult(arm=arm.name, round=round_)

    monkeypatch.setattr(bench.e2e, "hook_lock", no_lock)
    monkeypatch.setattr(bench.e2e, "learn_hotset", learn)
    monkeypatch.setattr(bench.e2e, "run_arm", run_arm)
    monkeypatch.setattr(bench.e2e, "host_config", lambda arm, s: bench.e2e.HOST_CONFIG)
    s = Settings(runtime=20, warmup=60, slow_warmup=60, gap=60, cache_mib=512, budget_mib=256,
                 disk=tmp_path / "disk.raw", disk_bytes=2 << 30, mount=tmp_path / "delay",
                 neighbour_file=tmp_path / "n", stream_rate="100m", reuse_iops=10000, reclaim_period=10.0,
                 out=tmp_path, guest_dir=str(tmp_path), memory_mib=384, model={})
    names = ["coldboot-hdd-evicted", "coldboot-hdd-warm", "coldboot-hdd-oracle"]
    arms = [every_arm()[n] for n in names]
    runs: list[dict] = []
    bench.e2e.run_rounds(arms, s, 4, runs)

    assert calls[0] == ("learn hdd", 0) and all(not c[0].startswith("learn") for c in calls[1:])
    by_round = {r: [name for name, rr in calls[1:] if rr == r] for r in range(1, 5)}
    assert by_round == {1: names, 2: names[1:] + names[:1], 3: names[2:] + names[:2], 4: names}
    assert [(row["arm"], row["round"], row["slot"]) for row in runs[:6]] == [
        (names[0], 1, 1), (names[1], 1, 2), (names[2], 1, 3), (names[1], 2, 1), (names[2], 2, 2), (names[0], 2, 3)]
