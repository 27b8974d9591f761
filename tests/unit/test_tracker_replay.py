"""DirtyTracker against QMP conversations recorded from QEMU 7.2 (fast, no QEMU).

The fake server fails the test on any command the recording does not have
at that point, so each test pins the exact command sequence as well as
what the tracker returns.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fakeqmp import FakeQMP, Normaliser
from vmcache.errors import BitmapReadError, MonitorBusyError, TrackerError
from vmcache.host.qmp import SocketMonitor
from vmcache.host.tracker import DirtyTracker
from vmcache.model.extents import BitmapRead, extents_to_blocks, merge_extents

KiB = 1024
MiB = 1024 * KiB
G = 64 * KiB


@pytest.fixture
def replay(tmp_path: Path):
    started: list[tuple[FakeQMP, SocketMonitor]] = []

    def start(name: str) -> DirtyTracker:
        norm = Normaliser({"@WORKDIR@": str(tmp_path)})
        fake = FakeQMP(name, tmp_path / "fake.qmp", norm)
        monitor = SocketMonitor(fake.socket_path, timeout=5)
        started.append((fake, monitor))
        tracker = DirtyTracker(monitor, "disk0-storage", runtime_dir=str(tmp_path / "run"), reader=fake.reader)
        norm.bind("@SESSION@", tracker.session)
        return tracker

    yield start
    for fake, monitor in started:
        monitor.close()
        fake.close()


def test_cycles_raw(replay, tmp_path: Path) -> None:
    t = replay("tracker-cycles-raw")
    t.start()
    assert os.stat(tmp_path / "run").st_mode & 0o777 == 0o700
    first = t.read()
    assert first.status is BitmapRead.OK
    assert first.extents.tolist() == [[0, G], [1 * MiB, 4 * G]]
    assert first.bytes == 5 * G
    assert t.read().extents.tolist() == []
    assert t.read().extents.tolist() == [[63 * MiB, 1 * MiB]]
    assert t.pending == ()
    t.stop()
    assert os.listdir(tmp_path / "run") == []


def test_cycles_qcow2_reports_file_offsets(replay) -> None:
    t = replay("tracker-cycles-qcow2")
    t.start()
    first = t.read().extents
    # Two data ranges plus metadata, all inside the (small) qcow2 file.
    assert 0 < len(first) and int(first[:, 0].max()) < 4 * MiB
    assert t.read().extents.tolist() == []
    assert len(t.read().extents) > 0
    t.stop()


def test_foreign_nbd_server_defers_merges_and_loses_nothing(replay) -> None:
    t = replay("tracker-deferred")
    t.start()
    one = t.read()
    assert one.status is BitmapRead.DEFERRED and one.deferred
    assert "NBD server already running" in one.reason and one.extents.shape == (0, 2)
    assert len(t.pending) == 1
    two = t.read()
    assert two.deferred
    assert len(t.pending) == 1  # the second period merged into the first
    three = t.read()
    assert three.status is BitmapRead.OK
    assert three.extents.tolist() == [[0, G], [2 * MiB, G], [3 * MiB, G]]
    assert t.pending == ()
    t.stop()


def test_failed_read_keeps_the_bitmap_for_the_next_read(replay) -> None:
    t = replay("tracker-read-failure")
    t.start()
    with pytest.raises(BitmapReadError):
        t.read()
    assert len(t.pending) == 1
    got = t.read()
    assert got.extents.tolist() == [[0, G], [5 * MiB, G]]
    assert t.pending == ()
    t.stop()


def test_start_removes_stale_bitmaps_of_ours_only(replay) -> None:
    # The recording removes vmcache-deadbeef-7 and -8; touching backup-full
    # would be a command the fake does not expect.
    t = replay("tracker-stale")
    t.start()
    assert t.active is not None and t.active.startswith("vmcache-")
    t.stop()
    assert t.active is None


def test_read_before_start_is_an_error(tmp_path: Path) -> None:
    class Never:
        def execute(self, command, arguments=None):
            raise AssertionError(f"sent {command}")

        def close(self) -> None:
            pass

    with pytest.raises(TrackerError, match="not started"):
        DirtyTracker(Never(), "n").read()
    with pytest.raises(TrackerError, match="power of two"):
        DirtyTracker(Never(), "n", granularity=3000)


def test_runtime_dir_open_to_others_is_refused(tmp_path: Path) -> None:
    class Never:
        def execute(self, command, arguments=None):
            raise AssertionError(f"sent {command}")

        def close(self) -> None:
            pass

    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    with pytest.raises(TrackerError, match="0700"):
        DirtyTracker(Never(), "n", runtime_dir=str(loose)).start()


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_runtime_dir_is_given_to_the_user_qemu_runs_as(tmp_path: Path) -> None:
    """On Debian QEMU runs as libvirt-qemu: it must be able to bind the NBD socket in the directory."""
    class Nodes:
        def execute(self, command, arguments=None):
            if command == "query-named-block-nodes":
                return [{"node-name": "n", "image": {"virtual-size": 1 << 20}, "dirty-bitmaps": []}]
            return {}

        def close(self) -> None:
            pass

    run = tmp_path / "nbd"
    DirtyTracker(Nodes(), "n", runtime_dir=str(run), socket_owner=(64055, 64056)).start()
    info = run.stat()
    assert (info.st_uid, info.st_gid, info.st_mode & 0o777) == (64055, 64056, 0o700)
    # An agent started again finds it so and accepts it; anyone else's is still refused.
    DirtyTracker(Nodes(), "n", runtime_dir=str(run), socket_owner=(64055, 64056)).start()
    with pytest.raises(TrackerError, match="0700"):
        DirtyTracker(Nodes(), "n", runtime_dir=str(run)).start()


# -- extents ----------------------------------------------------------------


def test_merge_extents() -> None:
    got = merge_extents(np.array([[100, 10], [0, 10], [10, 5], [105, 20], [50, 0]]))
    assert got.dtype == np.int64
    assert got.tolist() == [[0, 15], [100, 25]]
    assert merge_extents(np.zeros((0, 2))).shape == (0, 2)


def test_extents_to_blocks() -> None:
    ext = np.array([[0, 4096], [65536 * 2 + 100, 65536 * 3], [65536 * 9, 65536 * 5]])
    frac = extents_to_blocks(ext, 65536, 10)
    assert frac.dtype == np.float32 and frac.shape == (10,)
    expected = np.zeros(10)
    expected[0] = 4096 / 65536
    expected[2] = (65536 - 100) / 65536
    expected[3] = expected[4] = 1.0
    expected[5] = 100 / 65536
    expected[9] = 1.0  # the part past the last block is ignored
    np.testing.assert_allclose(frac, expected, rtol=1e-6)
    assert extents_to_blocks(np.zeros((0, 2), dtype=np.int64), 4096, 3).tolist() == [0, 0, 0]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 700)), max_size=30),
    st.sampled_from([1, 7, 64, 512]),
    st.integers(0, 40),
)
def test_extents_to_blocks_matches_a_byte_map(pairs, block, nblocks) -> None:
    size = block * nblocks
    written = np.zeros(max(size, 1) + 6000, dtype=bool)
    for offset, length in pairs:
        written[offset : offset + length] = True
    expected = written[:size].reshape(nblocks, block).mean(axis=1) if nblocks else np.zeros(0)
    got = extents_to_blocks(np.array(pairs, dtype=np.int64).reshape(-1, 2), block, nblocks)
    np.testing.assert_allclose(got, expected, atol=1e-6)
    merged = merge_extents(np.array(pairs, dtype=np.int64).reshape(-1, 2))
    assert int(merged[:, 1].sum()) == int(written.sum())


def test_a_new_monitor_serves_the_whole_read(tmp_path: Path) -> None:
    """After libvirtd restarts the worker hands the tracker a new monitor: bitmaps and NBD both use it."""
    class Recording:
        def __init__(self) -> None:
            self.commands: list[str] = []

        def execute(self, command, arguments=None):
            self.commands.append(command)
            if command == "query-named-block-nodes":
                return [{"node-name": "n", "image": {"virtual-size": 1 << 20}, "dirty-bitmaps": []}]
            return [] if command.startswith("query-") else {}

        def close(self) -> None:
            pass

    old, new = Recording(), Recording()
    tracker = DirtyTracker(old, "n", runtime_dir=str(tmp_path / "nbd"),
                           reader=lambda *a, **kw: np.zeros((0, 2), dtype=np.int64))
    tracker.start()
    tracker.monitor = new
    before = len(old.commands)
    assert tracker.read().status is BitmapRead.OK
    assert len(old.commands) == before
    assert {"transaction", "nbd-server-start", "block-export-add", "block-export-del", "nbd-server-stop"} <= set(
        new.commands)


class BusyOnce:
    """The monitor, but ``command`` is held back once (MonitorBusyError, nothing sent), as the agent's link
    holds a command back while libvirt runs a job of the domain."""

    def __init__(self, inner: SocketMonitor, command: str) -> None:
        self.inner, self.command, self.refused = inner, command, 0

    def execute(self, command: str, arguments=None):
        if command == self.command and not self.refused:
            self.refused += 1
            raise MonitorBusyError(f"{command}: busy")
        return self.inner.execute(command, arguments)


def test_a_command_held_back_by_a_libvirt_job_defers_the_read_and_loses_nothing(replay) -> None:
    t = replay("tracker-cycles-raw")
    t.start()
    t.monitor = busy = BusyOnce(t.monitor, "transaction")
    held = t.read()
    assert busy.refused == 1 and held.status is BitmapRead.DEFERRED and "busy" in held.reason
    first = t.read()   # the recorded conversation from its first read on: nothing was sent in between
    assert first.status is BitmapRead.OK and first.extents.tolist() == [[0, G], [1 * MiB, 4 * G]]
    assert t.read().extents.tolist() == []
    assert t.read().extents.tolist() == [[63 * MiB, 1 * MiB]]
    t.stop()


def test_a_removal_held_back_after_the_read_keeps_the_writes_read_and_goes_at_the_next_read(replay) -> None:
    # a block resize is a libvirt job: the removal of the bitmap just read is held back, the writes are not
    t = replay("tracker-cycles-raw")
    t.start()
    t.monitor = busy = BusyOnce(t.monitor, "block-dirty-bitmap-remove")
    first = t.read()
    assert busy.refused == 1
    assert first.status is BitmapRead.OK and first.extents.tolist() == [[0, G], [1 * MiB, 4 * G]]
    assert t.read().extents.tolist() == []   # the held-back removal went first, as the recording has it
    assert t.read().extents.tolist() == [[63 * MiB, 1 * MiB]]
    t.stop()
