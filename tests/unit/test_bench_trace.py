"""A real trace mapped onto the bench guest's disk: compaction, the fitting window, the iolog, the oracle."""

import gzip

import numpy as np
import pytest

from bench.e2e_trace import Trace, fitting_prefix, iolog, load, most_read, offset_map, replay

K = 64 << 10
MIB = 1 << 20


def trace(*requests: tuple[str, int, int]) -> Trace:
    n = len(requests)
    return Trace(np.arange(n, dtype=float), np.array([op == "W" for op, _, _ in requests]),
                 np.array([o for _, o, _ in requests], dtype=np.int64),
                 np.array([ln for _, _, ln in requests], dtype=np.int64))


def test_compaction_cuts_long_gaps_keeps_short_ones_and_the_order():
    # chunks 0 and 1 (one request across both), 3 (a 1-chunk gap: kept), 1000 (far: the gap is cut), 1001
    t = trace(("R", K - 4096, 8192), ("R", 3 * K + 512, 512), ("W", 1000 * K, 4096), ("R", 1001 * K + 8192, 4096))
    m = offset_map(t, chunk=K, keep_gap=4 * K)
    assert m.chunks.tolist() == [0, 1, 3, 1000, 1001] and m.targets.tolist() == [0, 1, 3, 4, 5]
    assert m(t.offsets).tolist() == [K - 4096, 3 * K + 512, 4 * K, 5 * K + 8192]
    assert m.size == 6 * K
    with pytest.raises(ValueError):
        m(np.array([2 * K]))    # not a chunk the trace touched


def test_the_window_is_the_longest_prefix_whose_map_fits_the_disk():
    t = trace(*(("R", i * 100 * MIB, 4096) for i in range(10)))   # every request a chunk of its own, far apart
    assert fitting_prefix(t, 4 * K, chunk=K, keep_gap=K) == 4
    assert fitting_prefix(t, 100 * K, chunk=K, keep_gap=K) == 10


def test_the_iolog_is_fio_version_2_on_the_guests_disk():
    t = trace(("R", 0, 4096), ("W", 8192, 512))
    assert iolog(t, np.array([4096, 12288])).splitlines() == [
        "fio version 2 iolog", "/dev/vda add", "/dev/vda open", "/dev/vda read 4096 4096",
        "/dev/vda write 12288 512", "/dev/vda close"]


def test_the_oracle_takes_the_most_read_blocks_up_to_the_budget_merged_in_disk_order():
    t = trace(("R", 0, MIB), ("R", 5 * MIB, 4096), ("R", MIB, MIB), ("R", MIB, 4096), ("W", 9 * MIB, 8 * MIB),
              ("R", 3 * MIB - 4096, 8192))
    # bytes read per block: 0: 1 MiB, 1: 1 MiB + 4 KiB, 2: 4 KiB, 3: 4 KiB, 5: 4 KiB; writes do not count
    assert most_read(t, t.offsets, budget=2 * MIB) == [(0, 2 * MIB)]
    assert most_read(t, t.offsets, budget=3 * MIB) == [(0, 3 * MIB)]      # ties: the lower block first
    assert most_read(t, t.offsets, budget=MIB) == [(MIB, MIB)]


def test_a_replay_splits_the_window_into_warm_up_and_measured_parts(tmp_path):
    path = tmp_path / "t.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write("time,op,offset,length\n")
        for i in range(100):
            f.write(f"{i / 10:.6f},{'W' if i % 4 == 0 else 'R'},{(i % 10) * 10 * MIB},4096\n")
    t = load(path)
    assert len(t) == 100 and int(t.writes.sum()) == 25 and t.times[-1] == pytest.approx(9.9)
    r = replay(t, 2 << 30, warmup_share=0.6, budget=MIB)
    assert r.requests == (60, 40) and r.disk_used == 10 * K
    assert r.warmup.count(" read ") + r.warmup.count(" write ") == 60
    assert r.measured.count("\n/dev/vda read ") == 30 and len(r.oracle) == 1
    assert replay(t, 2 << 30, 0.5, MIB, limit=10).requests == (5, 5)
