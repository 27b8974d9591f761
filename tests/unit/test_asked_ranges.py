"""Which ranges a dirty-bitmap read asks: the image file's data, widened, joined, capped.

cover_extents is pure (vmcache.model.extents); data_extents walks a real
sparse file with SEEK_DATA/SEEK_HOLE; asked_ranges puts them together.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from vmcache.host.allocation import FileData, data_extents
from vmcache.host.nbdexport import MAX_GAP, MAX_RANGES, asked_ranges
from vmcache.host.nbdreader import MAX_REQUEST, requests
from vmcache.host.tracker import DirtyTracker
from vmcache.model.extents import cover_extents

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
TiB = 1024 * GiB
G = 64 * KiB


def rows(*pairs: tuple[int, int]) -> np.ndarray:
    return np.array(pairs, dtype=np.int64).reshape(-1, 2)


def granules(extents: np.ndarray, granularity: int) -> set[int]:
    out: set[int] = set()
    for offset, length in extents.tolist():
        if length > 0:
            out.update(range(offset // granularity, (offset + length - 1) // granularity + 1))
    return out


def test_rows_are_widened_to_whole_granules_and_clipped_to_the_end() -> None:
    got = cover_extents(rows((100, 1), (3 * G - 1, 2), (10 * G + 5, G)), G, 11 * G - 7, max_gap=0, max_ranges=10)
    assert got.tolist() == [[0, G], [2 * G, 2 * G], [10 * G, G - 7]]


def test_near_rows_are_joined_far_ones_kept_apart() -> None:
    got = cover_extents(rows((0, G), (3 * G, G), (100 * G, G)), G, TiB, max_gap=2 * G, max_ranges=10)
    assert got.tolist() == [[0, 4 * G], [100 * G, G]]


def test_too_many_ranges_close_the_smallest_gaps_first() -> None:
    ext = rows((0, G), (10 * G, G), (12 * G, G), (50 * G, G), (53 * G, G))
    got = cover_extents(ext, G, TiB, max_gap=0, max_ranges=3)
    # gaps: 9G, 1G, 37G, 2G -> the 1G and 2G gaps close
    assert got.tolist() == [[0, G], [10 * G, 3 * G], [50 * G, 4 * G]]
    assert cover_extents(ext, G, TiB, max_gap=0, max_ranges=1).tolist() == [[0, 54 * G]]


def test_empty_overlapping_and_unsorted_input() -> None:
    assert cover_extents(rows(), G, TiB, max_gap=MAX_GAP, max_ranges=4).shape == (0, 2)
    assert cover_extents(rows((5 * G, 0)), G, TiB, max_gap=0, max_ranges=4).shape == (0, 2)
    got = cover_extents(rows((8 * G, 2 * G), (0, G), (9 * G, 3 * G)), G, TiB, max_gap=0, max_ranges=4)
    assert got.tolist() == [[0, G], [8 * G, 4 * G]]
    with pytest.raises(ValueError):
        cover_extents(rows((0, 1)), 0, TiB, max_gap=0, max_ranges=1)


@pytest.mark.parametrize("seed", range(20))
def test_every_touched_granule_is_covered_and_few_ranges(seed: int) -> None:
    rng = np.random.default_rng(seed)
    end = int(rng.integers(1, 1 << 20)) * 4096
    n = int(rng.integers(0, 300))
    starts = rng.integers(0, end, n)
    ext = np.column_stack((starts, np.minimum(rng.integers(1, 4 * MiB, n), end - starts))).astype(np.int64)
    max_ranges = int(rng.integers(1, 20))
    got = cover_extents(ext, G, end, max_gap=int(rng.integers(0, 8)) * G, max_ranges=max_ranges)
    assert granules(ext, G) <= granules(got, G)
    assert len(got) <= max_ranges
    assert all(0 <= o and o + n <= end and n > 0 for o, n in got.tolist())
    assert all(a + m < b for (a, m), (b, _) in zip(got.tolist(), got[1:].tolist()))  # sorted, apart


def test_requests_split_ranges_at_the_nbd_limit() -> None:
    todo = list(requests(rows((0, G), (TiB, MAX_REQUEST + 5))))
    assert todo == [(0, G), (TiB, MAX_REQUEST), (TiB + MAX_REQUEST, 5)]


def _sparse(path: Path, size: int, offsets: list[int], length: int) -> None:
    with open(path, "wb") as f:
        f.truncate(size)
        for offset in offsets:
            f.seek(offset)
            f.write(b"x" * length)


def test_data_extents_walks_a_sparse_file(tmp_path: Path) -> None:
    path = tmp_path / "sparse.raw"
    _sparse(path, 64 * GiB, [0, 20 * GiB, 64 * GiB - MiB], MiB)
    got = data_extents(str(path), stride=4096)
    assert got is not None
    extents, size, identity = got
    assert size == 64 * GiB
    assert identity == (path.stat().st_dev, path.stat().st_ino)
    # The file system may allocate a little around each write (its block size), never a far-off range.
    assert granules(extents, MiB) == {0, 20 * 1024, 64 * 1024 - 1}
    for offset in (0, 20 * GiB, 64 * GiB - MiB):
        assert any(o <= offset and offset + MiB <= o + n for o, n in extents.tolist())


def test_data_extents_are_widened_to_whole_strides(tmp_path: Path) -> None:
    path = tmp_path / "sparse.raw"
    _sparse(path, 64 * GiB, [0, 3 * MiB, 64 * MiB + 5, 20 * GiB + 70 * MiB], 4096)
    got = data_extents(str(path), stride=64 * MiB)
    assert got is not None
    assert got.extents.tolist() == [[0, 128 * MiB], [20 * GiB + 64 * MiB, 64 * MiB]]
    ragged = tmp_path / "ragged.raw"
    _sparse(ragged, 100 * MiB, [99 * MiB], 4096)
    got = data_extents(str(ragged), stride=64 * MiB)
    assert got is not None
    assert got.extents.tolist() == [[64 * MiB, 36 * MiB]]  # clipped to the file's end


def test_data_extents_of_an_empty_file_a_missing_file_and_a_device(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    got = data_extents(str(empty))
    assert got is not None and got[0].shape == (0, 2) and got[1] == 0
    hole = tmp_path / "hole"
    with open(hole, "wb") as f:
        f.truncate(GiB)
    got = data_extents(str(hole))
    assert got is not None and got[0].shape == (0, 2) and got[1] == GiB
    assert data_extents(str(tmp_path / "missing")) is None
    assert data_extents("/dev/null") is None  # not a regular file: the caller asks everywhere
    assert data_extents(str(tmp_path)) is None


def test_a_file_past_max_steps_counts_as_data_to_its_end(tmp_path: Path) -> None:
    path = tmp_path / "fragmented"
    _sparse(path, GiB, [k * 64 * MiB for k in range(5)], 4096)
    got = data_extents(str(path), stride=4096, max_steps=2)
    assert got is not None
    assert got.extents.tolist() == [[0, 4096], [64 * MiB, GiB - 64 * MiB]]  # two steps, then the rest
    assert data_extents(str(path), stride=4096, max_steps=6).extents.tolist() == [  # type: ignore[union-attr]
        [k * 64 * MiB, 4096] for k in range(5)
    ]


def test_asked_ranges_unknown_data_asks_everywhere() -> None:
    assert asked_ranges(None, TiB, G) is None


def test_asked_ranges_of_a_sparse_file() -> None:
    data = rows((0, MiB), (2 * TiB, 3 * MiB), (4 * TiB - MiB, MiB))
    got = asked_ranges(FileData(data, 4 * TiB, (1, 2)), 4 * TiB, G)
    assert got is not None
    assert got.tolist() == data.tolist()


def test_asked_ranges_ask_past_a_file_smaller_than_qemus_length() -> None:
    got = asked_ranges(FileData(rows((0, G)), GiB, (1, 2)), 30 * GiB, G)
    assert got is not None
    assert got.tolist() == [[0, G], [GiB, 29 * GiB]]


def test_asked_ranges_are_capped() -> None:
    data = rows(*((k * GiB, G) for k in range(1000)))
    got = asked_ranges(FileData(data, TiB, (1, 2)), TiB, G)
    assert got is not None and len(got) == MAX_RANGES
    assert granules(data, G) <= granules(got, G)


def test_data_extents_sees_data_written_but_not_yet_on_disk(tmp_path: Path) -> None:
    # Delayed allocation: a buffered write not yet written back is data already.
    path = tmp_path / "delalloc"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, GiB)
        os.pwrite(fd, b"y" * 4096, 512 * MiB)
        got = data_extents(str(path))
    finally:
        os.close(fd)
    assert got is not None
    assert got.extents.tolist() == [[512 * MiB, 64 * MiB]]


class _Monitor:
    """Just enough QMP for a tracker's read: one storage node on ``path``."""

    def __init__(self, path: Path, size: int, driver: str = "file") -> None:
        self.node = {"node-name": "n", "drv": driver, "file": str(path), "image": {"virtual-size": size},
                     "dirty-bitmaps": []}

    def execute(self, command: str, arguments: object = None) -> object:
        if command == "query-named-block-nodes":
            return [self.node]
        return [] if command.startswith("query-") else {}

    def close(self) -> None:
        pass


def _tracker(tmp_path: Path, monitor: _Monitor, asked: list[object]) -> DirtyTracker:
    """A tracker whose bitmap reader notes the ranges it is asked to read."""

    def reader(*args: object, ranges: object = None, **kwargs: object) -> np.ndarray:
        asked.append(None if ranges is None else np.asarray(ranges).tolist())
        return np.zeros((0, 2), dtype=np.int64)

    return DirtyTracker(monitor, "n", runtime_dir=str(tmp_path / "nbd"), reader=reader)


def _tracker_asks(tmp_path: Path, monitor: _Monitor) -> list[object]:
    asked: list[object] = []
    with _tracker(tmp_path, monitor, asked) as tracker:
        tracker.read()
    return asked


def test_a_tracker_asks_where_its_image_file_holds_data(tmp_path: Path) -> None:
    path = tmp_path / "disk.raw"
    with open(path, "wb") as f:
        f.truncate(TiB)
        f.seek(TiB // 2)
        f.write(b"z" * 4096)
    assert _tracker_asks(tmp_path, _Monitor(path, TiB)) == [[[TiB // 2, 64 * MiB]]]  # a whole stride


def test_a_tracker_asks_everywhere_for_a_device_or_a_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "disk.raw"
    path.write_bytes(b"x" * 4096)
    assert _tracker_asks(tmp_path, _Monitor(path, 4096, driver="host_device")) == [None]
    assert _tracker_asks(tmp_path, _Monitor(tmp_path / "gone.raw", 4096)) == [None]


def test_a_tracker_asks_everywhere_once_the_path_names_another_file(tmp_path: Path, caplog) -> None:
    path = tmp_path / "disk.raw"
    with open(path, "wb") as f:
        f.truncate(GiB)
    asked: list[object] = []
    with _tracker(tmp_path, _Monitor(path, GiB), asked) as tracker:
        tracker.read()
        replacement = tmp_path / "new.raw"
        with open(replacement, "wb") as f:
            f.truncate(GiB)
        os.replace(replacement, path)  # QEMU still writes the old file, which the path no longer names
        tracker.read()
        tracker.read()
    assert asked == [[], None, None]
    assert caplog.text.count("tracker.image_replaced") == 1


def test_a_walk_through_data_scattered_everywhere_gives_up_early(tmp_path: Path) -> None:
    # A piece in every other 64 MiB stride: no step skips enough hole to pay for itself.
    path = tmp_path / "scattered"
    _sparse(path, TiB, [k * 128 * MiB for k in range(400)], 4096)
    got = data_extents(str(path))
    assert got is not None
    extents = got.extents.tolist()
    assert extents[-1][0] + extents[-1][1] == TiB  # the rest counts as data
    assert 256 <= len(extents) <= 258  # gave up after 256 steps
    assert all(o % (64 * MiB) == 0 for o, _ in extents)


def test_a_walk_through_far_apart_data_goes_on(tmp_path: Path) -> None:
    # 300 pieces 4 GiB apart: every step skips a big hole, so all are found.
    path = tmp_path / "far"
    _sparse(path, 1200 * GiB, [k * 4 * GiB for k in range(300)], 4096)
    got = data_extents(str(path))
    assert got is not None
    assert got.extents.tolist() == [[k * 4 * GiB, 64 * MiB] for k in range(300)]
