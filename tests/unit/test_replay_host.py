"""Host mode of the replay: several VMs against one pinned cap (vmcache.replay.host)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from vmcache.cli import main
from vmcache.replay import generate, host
from vmcache.replay.host import HostVm, replay_host, static_grants
from vmcache.replay.trace import write_csv

MiB = 1 << 20
BS = 64 << 10


def small_case() -> list[HostVm]:
    """A hot zoned VM, a VM streaming over its disk, and one nearly idle; budgets well over the cap."""
    size = 64 * MiB
    return [
        HostVm("stream", generate.stream(size, 6000, rate=40, io_size=BS, seed=1), 32 * MiB, size_bytes=size),
        HostVm("zoned", generate.zoned(size, 6000, rate=40, seed=2), 32 * MiB, size_bytes=size),
        HostVm("idle", generate.zoned(size, 30, rate=0.2, seed=3), 32 * MiB, size_bytes=size),
    ]


def test_static_grants():
    vms = [HostVm(n, generate.zipf(MiB, 10), b * MiB) for n, b in (("a", 30), ("b", 10), ("c", 60))]
    assert static_grants("first-come", vms, 50 * MiB) == {"a": 30 * MiB, "b": 10 * MiB, "c": 10 * MiB}
    assert static_grants("equal", vms, 50 * MiB) == {"a": 20 * MiB, "b": 10 * MiB, "c": 20 * MiB}
    assert static_grants("proportional", vms, 50 * MiB) == {"a": 15 * MiB, "b": 5 * MiB, "c": 30 * MiB}
    with pytest.raises(ValueError):
        static_grants("benefit", vms, 1)


def test_host_replay_is_deterministic_and_within_the_cap():
    vms = small_case()
    first = replay_host(vms, [8 * MiB], block_size=BS)
    again = replay_host(vms, [8 * MiB], block_size=BS)
    assert [r.to_json() for r in first] == [r.to_json() for r in again]
    assert [r.arm for r in first] == list(host.ARMS)
    for r in first:
        assert r.total.accesses == sum(v.accesses for v in r.vms.values())
        assert r.total.hits == sum(v.hits for v in r.vms.values())
        assert r.total.device_reads == sum(v.device_reads for v in r.vms.values())
        assert r.total.requests == sum(v.requests for v in r.vms.values())
        for vm in vms:  # each VM's own accesses, reads and requests
            assert r.vms[vm.name].read_accesses == int((~vm.trace.write).sum()) and r.vms[vm.name].requests == len(vm.trace)
        assert sum(r.grant_mean.values()) <= 8 * MiB
        assert sum(r.pinned_mean.values()) <= 8 * MiB
    by_arm = {r.arm: r for r in first}
    # the stream would evict the zoned VM's hot zones from a shared cache: pinning them by benefit wins
    assert by_arm["benefit"].total.device_reads <= min(r.total.device_reads for r in first)
    assert by_arm["benefit"].grant_mean["zoned"] > by_arm["benefit"].grant_mean["idle"]
    # first come: the stream, listed first, takes the whole cap
    assert by_arm["first-come"].grant_mean["stream"] == 8 * MiB


def test_cap_above_memory_and_bad_vms_are_refused():
    vms = small_case()
    with pytest.raises(ValueError):
        replay_host(vms, [8 * MiB], block_size=BS, memory=4 * MiB)
    with pytest.raises(ValueError):
        replay_host(vms + vms[:1], [8 * MiB], block_size=BS)
    with pytest.raises(ValueError):
        replay_host([], [8 * MiB], block_size=BS)


def test_cli_host_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = []
    for vm in small_case():
        path = tmp_path / f"{vm.name}.csv"
        write_csv(vm.trace, path)
        args += ["--vm", f"{path},budget=32M,size=64M" + (",min=1M" if vm.name == "idle" else "")]
    plot = tmp_path / "host.png"
    assert main(["replay", *args, "--cap", "4M,8M", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "device reads per guest request" in out and "benefit" in out and "first-come" in out and "min 1MiB" in out
    assert "reads counted" in out.splitlines()[0]  # the agents' default
    assert "pins loaded per guest request" in out and "the guest read within 2 minutes" in out
    assert plot.read_bytes().startswith(b"\x89PNG")
    assert main(["replay", *args, "--cap", "8M", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["arm"] for r in rows} == set(host.ARMS)
    benefit = next(r for r in rows if r["arm"] == "benefit")
    assert benefit["vms"]["idle"]["grant_mean_bytes"] >= 1 * MiB  # its guaranteed minimum
    assert main(["replay", *args, "--cap", "8M", "--json", "--prefetch-rate", "16K"]) == 0
    limited = next(r for r in json.loads(capsys.readouterr().out) if r["arm"] == "benefit")
    assert limited["loaded_units"] < benefit["loaded_units"]


def test_the_models_decide_on_counted_reads_unless_inferred_ones_are_asked_for(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The agents' default read model is the host replay's: inferred reads are an option, as in the agent."""
    vms = small_case()
    inferred = {r.arm: r.to_json() for r in replay_host(vms, [8 * MiB], block_size=BS, arms=("benefit",))}
    counted = {r.arm: r.to_json() for r in replay_host(vms, [8 * MiB], block_size=BS, arms=("benefit",), exact=True)}
    assert inferred["benefit"] != counted["benefit"]  # the two paths pin differently on this case
    args = []
    for vm in vms:
        path = tmp_path / f"{vm.name}.csv"
        write_csv(vm.trace, path)
        args += ["--vm", f"{path},budget=32M,size=64M"]
    for model, expected in ((None, counted), ("inferred", inferred), ("counted", counted)):
        extra = [] if model is None else ["--read-model", model]
        assert main(["replay", *args, "--cap", "8M", "--block-size", "64K", "--json", *extra]) == 0
        rows = {r["arm"]: r for r in json.loads(capsys.readouterr().out)}
        assert rows["benefit"] == expected["benefit"], model


def test_the_read_model_is_refused_for_a_single_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "t.csv").write_text("time,op,offset,length\n0,R,0,4096\n")
    assert main(["replay", str(tmp_path / "t.csv"), "--read-model", "counted"]) == 2
    assert "--read-model: 'counted': is for host mode (--vm)" in capsys.readouterr().err


@pytest.mark.parametrize("vm, message", [
    ("t.csv", "--vm[0]: 't.csv': needs budget=SIZE"),
    ("t.csv,budget=1M,min=2M", "--vm[0] min: '2M': must not be above the budget"),
    ("t.csv,budget=1M,colour=red", "--vm[0]: 't.csv,budget=1M,colour=red': use TRACE,budget=SIZE[,min=SIZE][,name=N][,size=SIZE][,start=DURATION]"),
    ("t.csv,budget=1M,start=5s", "--vm[0] start: '5s': is past the trace's last request"),
    ("t.csv,budget=1M --policy lru", "--policy: ['lru']: host mode runs its arms; only --policy warm (a restart)"),
    ("t.csv,budget=1M --cache-unit 24K", "--cache-unit: 24576: must divide --block-size (65536)"),
])
def test_cli_host_mode_bad_vm(tmp_path: Path, capsys: pytest.CaptureFixture[str], vm: str, message: str,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.csv").write_text("time,op,offset,length\n0,R,0,4096\n")
    assert main(["replay", "--vm", *vm.split(" "), "--cap", "1M"]) == 2
    assert capsys.readouterr().err.strip() == f"vmcache replay: {message}"


def test_stream_generator_is_sequential():
    t = generate.stream(MiB, 300, io_size=BS, seed=4)
    steps = np.diff(t.offset) % MiB
    assert set(steps.tolist()) == {BS}
    assert not t.write.any()


@pytest.mark.parametrize("unit, per", [(BS, 1), (4096, 16)])
def test_merged_accesses_keep_each_vm_s_own(unit: int, per: int) -> None:
    vms = small_case()
    merged = host._merge(vms, unit, per)
    assert merged.bt.write.dtype == bool and merged.bt.costly.dtype == bool
    for i, vm in enumerate(vms):
        mine = merged.vm == i
        assert int(merged.bt.write[mine].sum()) == int(vm.trace.write.sum()) * (BS // unit if vm.name == "stream" else 1)
        assert np.unique(merged.bt.request[mine]).size == len(vm.trace)
        assert merged.offsets[i] <= merged.bt.block[mine].min() and merged.bt.block[mine].max() < merged.offsets[i] + merged.units[i]
        assert merged.offsets[i] % per == 0 and merged.units[i] % per == 0


def test_page_units_keep_what_a_guest_touched_and_pins_hold_and_load_whole_blocks() -> None:
    """With 4 KiB units the shared cache holds the pages the guests read, pins their whole 64 KiB blocks."""
    vms = small_case()
    pages = {r.arm: r for r in replay_host(vms, [8 * MiB], block_size=BS, cache_unit=4096)}
    blocks = {r.arm: r for r in replay_host(vms, [8 * MiB], block_size=BS)}
    for arm in ("linux", "benefit"):
        assert pages[arm].total.requests == blocks[arm].total.requests
        # the zoned VM's 4 KiB reads: one unit per request either way
        zoned_reads = int((~vms[1].trace.write).sum())
        assert pages[arm].vms["zoned"].read_accesses == blocks[arm].vms["zoned"].read_accesses == zoned_reads
    # a 64 KiB stream request is 16 page units, one block unit
    assert pages["linux"].vms["stream"].accesses == 16 * blocks["linux"].vms["stream"].accesses
    assert sum(pages["benefit"].pinned_mean.values()) <= 8 * MiB
    loaded = pages["benefit"].total.extra["loaded_units"]
    assert loaded > 0


def test_loads_are_counted_apart_and_bounded_by_the_prefetch_rate() -> None:
    vms = small_case()
    free = {r.arm: r for r in replay_host(vms, [8 * MiB], block_size=BS)}
    assert "loaded_units" not in free["linux"].total.extra  # nobody pins in a shared arm
    loaded = free["benefit"].total.extra["loaded_units"]
    assert loaded > 0 and loaded == sum(v.extra["loaded_units"] for v in free["benefit"].vms.values())
    assert free["benefit"].total.extra["loaded_per_request"] == round(loaded / free["benefit"].total.requests, 6)
    rate = 16 << 10  # 16 KiB a trace second: a 64 KiB block every 4 s per VM
    slow = {r.arm: r for r in replay_host(vms, [8 * MiB], block_size=BS, prefetch_rate=rate)}
    duration = max(float(vm.trace.time[-1]) for vm in vms) + 10.0
    for arm in ("equal", "benefit"):
        per_vm = slow[arm].vms
        assert all(v.extra["loaded_units"] <= duration * rate / BS + 1 for v in per_vm.values()), arm
    assert slow["benefit"].total.extra["loaded_units"] < loaded
