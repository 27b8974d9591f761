"""bench/alternating_traces.py: two VMs busy in turn (the alternating pair, as replay traces)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.alternating_traces import alternating, main
from vmcache.replay.trace import read_trace

MiB = 1 << 20


def test_each_vm_is_busy_in_its_own_turns_on_its_hot_zone() -> None:
    first, second = (alternating(vm, phase=10.0, turns=4, rate=50.0, size=64 * MiB) for vm in (0, 1))
    assert len(first) == len(second) == 2 * 500
    turn = lambda t: (t.time // 10.0).astype(int)  # noqa: E731
    assert set(turn(first).tolist()) == {0, 2} and set(turn(second).tolist()) == {1, 3}
    assert np.all(np.diff(first.time) >= 0)
    per_mib = np.bincount(first.offset // MiB, minlength=64)
    densest = max(per_mib[i:i + 7].sum() for i in range(58)) / len(first)
    assert 0.85 < densest < 0.97  # one zone, 10% of the disk (6.4 of 64 MiB), takes 90% of the requests
    assert 0.1 < first.write.mean() < 0.3


def test_every_turn_reads_the_zone_fio_reads_at_the_disk_s_start() -> None:
    """fio's zoned:90/10:10/90 (guest/init) puts the hot zone in the first 10% of the disk, every run alike."""
    vm = alternating(0, phase=10.0, turns=6, rate=200.0, size=64 * MiB)
    zone = 64 * MiB // 10
    for k in (0, 2, 4):
        turn = vm.offset[(vm.time >= 10.0 * k) & (vm.time < 10.0 * (k + 1))]
        assert 0.87 < (turn < zone).mean() < 0.93, k


def test_main_writes_the_same_seeded_files(tmp_path: Path) -> None:
    for out in (tmp_path / "a", tmp_path / "b"):
        assert main([str(out), "--phase", "2", "--turns", "3", "--rate", "20"]) == 0
    assert (tmp_path / "a" / "vm1.csv").read_bytes() == (tmp_path / "b" / "vm1.csv").read_bytes()
    assert len(read_trace(tmp_path / "a" / "vm1.csv")) == 80 and len(read_trace(tmp_path / "a" / "vm2.csv")) == 40
