"""Host mode's restart: every VM from its saved set, the warm-ups paced by one host budget (vmcache.replay.hostwarm)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from vmcache.cli import main
from vmcache.model import warmshare
from vmcache.replay import generate
from vmcache.replay.host import HostVm
from vmcache.replay.hostwarm import RestartResult, replay_restart
from vmcache.replay.restartreport import restart_tables
from vmcache.replay.trace import write_csv

MiB = 1 << 20
BS = MiB
PREFETCH, WARM = MiB // 8, MiB      # 1.25 MiB of its own a 10 s cycle; the host's 10 MiB a cycle


def fleet() -> list[HostVm]:
    """Four zoned VMs whose hot zones (10% of the image) differ in size: 6.4 to 25.6 MiB, all within budget."""
    return [HostVm(f"vm{i}", generate.zoned(size, 3000, rate=10, seed=i), 32 * MiB, size_bytes=size)
            for i, size in enumerate((64 * MiB, 128 * MiB, 256 * MiB, 128 * MiB))]


@pytest.fixture(scope="module")
def restart() -> dict[str, RestartResult]:
    results = replay_restart(fleet(), [128 * MiB], block_size=BS, cache_unit=4096, warm_rate=WARM,
                             prefetch_rate=PREFETCH)
    return {r.pacing: r for r in results}


def test_one_host_budget_bounds_what_all_vms_load_a_cycle_and_the_last_vm_waits(restart) -> None:
    shared, alone = restart["shared"], restart["per-agent"]
    own = len(fleet()) * PREFETCH * 10                       # every VM's own prefetch tokens of a cycle
    per_cycle = shared.host_loaded_per_cycle()
    assert per_cycle[0] <= WARM * 10 + own                    # the budget starts full: one burst
    assert all(b <= WARM * 10 + own for b in per_cycle[1:])
    assert shared.last_done_s is not None and shared.last_done_s >= 20   # sets of 58 MiB through 10 MiB a cycle
    # each agent at the full rate: the device asked for all of them at once
    assert all(vm.loaded_per_cycle[0] >= 0.95 * WARM * 10 for vm in alone.vms)
    assert alone.host_loaded_per_cycle()[0] > 2 * per_cycle[0]
    saved = sum(vm.saved_bytes for vm in shared.vms)
    assert saved == sum(vm.saved_bytes for vm in alone.vms) and saved > 4 * WARM * 10
    assert shared.last_most_s is not None and shared.last_most_s <= shared.last_done_s
    for vm in shared.vms:
        assert vm.restored_bytes + vm.given_up_bytes == vm.saved_bytes
        assert vm.most_s is not None and vm.done_s is not None and vm.most_s <= vm.done_s
        assert vm.restore_unread_bytes <= vm.restore_loaded_bytes


def test_the_densest_set_is_back_first_and_a_warm_restart_reads_the_device_less_than_a_cold_one(restart) -> None:
    shared = restart["shared"]
    done = {vm.name: vm.done_s for vm in shared.vms}
    # the 64 MiB image's zone is the densest (its guest's reads fall on the fewest blocks) and comes first
    assert done["vm0"] == min(d for d in done.values() if d is not None)
    for vm in shared.vms:
        assert vm.reads[300.0] < vm.cold_reads[300.0], vm.name
        assert vm.cold_reads == restart["per-agent"].vms[shared.vms.index(vm)].cold_reads   # one cold start
    text = restart_tables(list(restart.values()))
    assert "pacing shared (warm-up 1MiB/s for the host)" in text and "pacing per-agent (warm-up 1MiB/s each)" in text
    assert text.count("\nall ") == 4 and "vm3" in text


def test_the_division_is_model_warmshares(monkeypatch: pytest.MonkeyPatch) -> None:
    """The replay pays restores through vmcache.model.warmshare, the agents' rule: grant nothing, and no VM
    restores anything (its own prefetch tokens pay only for its other new pins)."""
    monkeypatch.setattr(warmshare, "warm_grant", lambda *args, **kwargs: 0)
    (shared,) = replay_restart(fleet(), [128 * MiB], block_size=BS, cache_unit=4096, warm_rate=WARM,
                               prefetch_rate=PREFETCH, pacings=("shared",))
    assert all(vm.restore_loaded_bytes == 0 for vm in shared.vms)
    assert all(b <= len(fleet()) * PREFETCH * 10 for b in shared.host_loaded_per_cycle())


def test_at_the_default_prefetch_rate_the_host_budget_still_paces_the_restores() -> None:
    """Each disk's own 8 MiB/s (80 MiB a cycle) would pay all four sets in the first cycle; the restores read
    what the host's budget grants, 10 MiB a cycle here, and the last set is back only after several."""
    (shared,) = replay_restart(fleet(), [128 * MiB], block_size=BS, cache_unit=4096, warm_rate=WARM,
                               prefetch_rate=8 * MiB, pacings=("shared",))
    assert sum(vm.saved_bytes for vm in shared.vms) > 4 * WARM * 10
    assert shared.last_done_s is not None and shared.last_done_s >= 30


def test_a_restart_is_refused_unpaced_or_with_an_unknown_pacing() -> None:
    with pytest.raises(ValueError):
        replay_restart(fleet(), [128 * MiB], block_size=BS, warm_rate=0, prefetch_rate=PREFETCH)
    with pytest.raises(ValueError):
        replay_restart(fleet(), [128 * MiB], block_size=BS, warm_rate=WARM, prefetch_rate=PREFETCH, pacings=("x",))


def test_a_trace_since_a_second_starts_there_at_zero() -> None:
    t = generate.zoned(MiB, 100, rate=10, seed=1)
    later = t.since(5.0)
    assert len(later) == int((t.time >= 5.0).sum()) and later.time[0] == pytest.approx(t.time[t.time >= 5.0][0] - 5.0)
    assert np.array_equal(later.offset, t.offset[t.time >= 5.0])


def test_cli_restart(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = []
    for vm in fleet()[:2]:
        path = tmp_path / f"{vm.name}.csv"
        write_csv(vm.trace, path)
        args += ["--vm", f"{path},budget=32M", "--vm", f"{path},budget=16M,start=100s,name={vm.name}-late"]
    common = ["replay", *args, "--cap", "96M", "--block-size", "1M", "--cache-unit", "4K", "--policy", "warm",
              "--prefetch-rate", "128K", "--warm-rate", "1M"]
    assert main(common) == 0
    out = capsys.readouterr().out
    assert out.startswith("restart: 4 VMs") and "vm1-late" in out and "pacing shared" in out
    assert main([*common, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["pacing"] for r in rows] == ["shared", "per-agent"] and len(rows[0]["vms"]) == 4
    assert main([*common, "--fill", "cached"]) == 2
    assert "a restart restores its sets" in capsys.readouterr().err
