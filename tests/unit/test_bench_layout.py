"""The end-to-end bench's cgroup layouts, partition limits, arm sets and the alternating pair's runs."""

import pytest

from bench.e2e_arms import GOALS, SCENARIOS, SETS, every_arm, group
from bench.e2e_layout import Layout, layout, limits
from bench.e2e_plan import busy_runs, plan

MIB = 1 << 20


def test_the_same_layout_is_one_cgroup_for_the_vm_and_its_neighbour():
    lay = layout("same", 1, neighbour=True, root="r")
    assert lay == Layout("r", ("r",), "r") and lay.children == ()
    assert layout("same", 1, neighbour=False, root="r").neighbour is None
    with pytest.raises(ValueError):
        layout("same", 2, neighbour=False)


def test_the_sibling_layout_gives_each_vm_and_the_neighbour_a_child_of_the_parent():
    assert layout("sibling", 1, neighbour=True, root="r") == Layout("r", ("r/vm",), "r/nb")
    pair = layout("sibling", 2, neighbour=False, root="r")
    assert pair == Layout("r", ("r/vm1", "r/vm2"), None) and pair.children == ("r/vm1", "r/vm2")


def test_every_mode_limits_the_parent_to_the_anon_plus_the_cache_room():
    lay = layout("sibling", 1, neighbour=True, root="r")
    for mode in ("kernel", "vmcache", "oracle"):
        assert limits(lay, mode, [370 * MIB], 512 * MIB, 256 * MIB) == {"r": 882 * MIB}


def test_a_partition_beside_a_neighbour_gives_the_vm_its_anon_plus_the_budget_and_the_neighbour_the_rest():
    lay = layout("sibling", 1, neighbour=True, root="r")
    assert limits(lay, "partition", [370 * MIB], 512 * MIB, 256 * MIB) == {
        "r": 882 * MIB, "r/vm": 626 * MIB, "r/nb": 256 * MIB}
    with pytest.raises(ValueError):   # the budget leaves the neighbour nothing
        limits(lay, "partition", [370 * MIB], 256 * MIB, 256 * MIB)


def test_a_partition_of_two_vms_alone_splits_the_room_equally():
    lay = layout("sibling", 2, neighbour=False, root="r")
    assert limits(lay, "partition", [370 * MIB, 380 * MIB], 320 * MIB, 256 * MIB) == {
        "r": 1070 * MIB, "r/vm1": 530 * MIB, "r/vm2": 540 * MIB}
    with pytest.raises(ValueError):
        limits(layout("same", 1, neighbour=True), "partition", [1], 2, 1)
    with pytest.raises(ValueError):
        limits(lay, "kernel", [1], 2, 1)


def test_an_alternating_guest_prints_results_for_its_busy_runs_and_the_pair_measures_one_each():
    p = plan(group("alternate", "ssd", ("kernel",))[0])
    assert p.loops == 4 and p.measured == (2, 3)
    assert busy_runs(4, 0) == [0, 2] and busy_runs(4, 1) == [1, 3] and busy_runs(2, None) == [0, 1]
    assert [[i for i in p.measured if i in busy_runs(p.loops, ph)] for ph in (0, 1)] == [[2], [3]]


def test_partitions_only_where_there_is_a_second_cgroup_and_no_oracle_for_the_pair():
    assert "partition" not in SCENARIOS["reuse"].modes and "partition" in SCENARIOS["sibreuse"].modes
    assert "oracle" not in SCENARIOS["alternate"].modes
    with pytest.raises(ValueError):
        group("reuse", "ssd", ("partition",))
    arms = every_arm()
    for arms_of_set in SETS.values():
        for arm in arms_of_set:
            assert arms[arm.name] == arm
    for goal in GOALS:
        assert all(ref in arms for ref in goal.references)


def test_min_mib_puts_a_guaranteed_minimum_in_the_vmcache_arms_metadata_only(tmp_path) -> None:
    from pathlib import Path

    from bench.e2e_plan import Vm
    from bench.e2e_run import domain_of

    def settings(min_mib: int):
        return bench_settings(tmp_path, min_mib=min_mib)

    by_name = every_arm()
    vm = Vm("g1", tmp_path / "disk.raw", "machine/g1", Path(tmp_path / "console.log"), phase=0)
    assert 'min="117440512"' in domain_of(by_name["alternate-ssd-vmcache"], settings(112), vm)
    assert "min=" not in domain_of(by_name["alternate-ssd-vmcache"], settings(0), vm)
    assert "vmcache:cache" not in domain_of(by_name["alternate-ssd-partition"], settings(112), vm)


def test_the_inferred_mode_runs_opted_in_agents_on_inferred_reads_over_the_installed_or_the_pairs_config(
        tmp_path, monkeypatch) -> None:
    from pathlib import Path

    import yaml

    import bench.e2e
    from bench.e2e_plan import Vm
    from bench.e2e_run import domain_of, host_config
    from vmcache.host.configfile import load_host_config

    s = installed_settings(tmp_path, monkeypatch, "pinned_cap: 512M\nmin_free: 1G\n")
    by_name = every_arm()
    one, pair, pair_default = (by_name[n] for n in ("sibreuse-ssd-inferred", "alternate-ssd-inferred",
                                                      "alternate-ssd-vmcache"))
    bench.e2e.write_host_configs(s, [one, pair, pair_default])

    assert yaml.safe_load(Path(host_config(one, s)).read_text()) == {
        "pinned_cap": "512M", "min_free": "1G", "read_model": "inferred"}
    assert yaml.safe_load(Path(host_config(pair, s)).read_text()) == {"pinned_cap": "224M", "read_model": "inferred"}
    assert yaml.safe_load(Path(host_config(pair_default, s)).read_text()) == {"pinned_cap": "224M"}
    assert load_host_config(host_config(one, s)).read_model == "inferred"
    assert load_host_config(host_config(pair_default, s)).read_model == "counted"
    vm = Vm("g1", tmp_path / "disk.raw", "machine/g1", Path(tmp_path / "console.log"), phase=0)
    assert "vmcache:cache" in domain_of(one, s, vm)     # the hook starts its agent, as in a vmcache arm


def test_the_nopin_mode_runs_opted_in_agents_whose_host_cap_is_zero(tmp_path, monkeypatch) -> None:
    from pathlib import Path

    import bench.e2e
    from bench.e2e_plan import Vm
    from bench.e2e_run import domain_of, host_config
    from vmcache.host.configfile import load_host_config

    s = installed_settings(tmp_path, monkeypatch, "pinned_cap: 512M\n")
    arm = every_arm()["qd32-ssd-nopin"]
    bench.e2e.write_host_configs(s, [arm])
    config = load_host_config(host_config(arm, s))
    assert config.pinned_cap.bytes_for(1 << 40) == 0 and config.read_model == "counted"
    vm = Vm("g1", tmp_path / "disk.raw", "machine/g1", Path(tmp_path / "console.log"), phase=0)
    assert "vmcache:cache" in domain_of(arm, s, vm)


def bench_settings(tmp_path, **extra):
    """The bench's default settings with everything under ``tmp_path`` (``extra`` replaces or adds)."""
    from bench.e2e_plan import Settings

    return Settings(**{"runtime": 20, "warmup": 60, "slow_warmup": 60, "gap": 60, "cache_mib": 512,
                       "budget_mib": 256, "disk": tmp_path / "disk.raw", "disk_bytes": 2 << 30,
                       "mount": tmp_path / "delay", "neighbour_file": tmp_path / "n", "stream_rate": "100m",
                       "reuse_iops": 10000, "reclaim_period": 10.0, "out": tmp_path, "guest_dir": str(tmp_path),
                       "memory_mib": 384, "model": {}, **extra})


def installed_settings(tmp_path, monkeypatch, config: str):
    """:func:`bench_settings`, with ``config`` as the installed host config."""
    import bench.e2e

    installed = tmp_path / "vmcache.yaml"
    installed.write_text(config)
    monkeypatch.setattr(bench.e2e, "HOST_CONFIG", str(installed))
    return bench_settings(tmp_path)
