"""The dirty-bitmap tracker against real QEMU 7.2: qemu-system-x86_64 (paused,
virtio-blk writethrough), qemu-storage-daemon, and a libvirt domain.

Writes go through QEMU's block layer (HMP qemu-io on the device, or an NBD
export on qemu-storage-daemon); the tracker must report exactly the
granularity blocks written, cycle after cycle, and leave nothing behind.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.qemu_helpers import (
    DEVICE_ID,
    FORMAT_NODE,
    QDEV,
    STORAGE_NODE,
    QemuVM,
    StorageDaemon,
    have_qemu,
    image,
    qemu_img_map,
)
from vmcache.errors import BitmapReadError, CommandNotAllowedError, DiskNotFoundError, QMPCommandError
from vmcache.host.blockdev import discover_disks, find_disk
from vmcache.host.qmp import LibvirtMonitor, SocketMonitor, hmp
from vmcache.host.tracker import DirtyTracker
from vmcache.model.extents import BitmapRead

pytestmark = [
    pytest.mark.live,
    pytest.mark.skipif(not have_qemu(), reason="needs qemu-system-x86_64 and qemu-img"),
]

KiB = 1024
MiB = 1024 * KiB
PREFIX = "vmcache-"


def blocks(ranges: list[tuple[int, int]], granularity: int) -> list[list[int]]:
    """The granularity blocks ``ranges`` touch, merged, as ``[offset, length]`` rows."""
    mask = np.zeros(0, dtype=bool)
    for offset, length in ranges:
        first, last = offset // granularity, (offset + length - 1) // granularity
        if last >= len(mask):
            mask = np.concatenate([mask, np.zeros(last + 1 - len(mask), dtype=bool)])
        mask[first : last + 1] = True
    rows, start = [], None
    for i, dirty in enumerate(list(mask) + [False]):
        if dirty and start is None:
            start = i
        elif not dirty and start is not None:
            rows.append([start * granularity, (i - start) * granularity])
            start = None
    return rows


def assert_nothing_left(driver) -> None:
    """No bitmap, node or export of ours; no NBD server running."""
    for node in driver("query-named-block-nodes", flat=True):
        assert not node["node-name"].startswith(PREFIX)
        ours = [b["name"] for b in node.get("dirty-bitmaps", []) if b["name"].startswith(PREFIX)]
        assert ours == [], node["node-name"]
    assert driver("query-block-exports") == []
    # nbd-server-stop fails when no server runs: ours was stopped.
    with pytest.raises(Exception, match="NBD server not running"):
        driver("nbd-server-stop")


@pytest.fixture
def vm_factory(tmp_path: Path) -> Iterator:
    made: list[QemuVM] = []

    def make(fmt: str, size: str = "64M") -> QemuVM:
        img = image(tmp_path / f"disk.{fmt}", fmt, size)
        vm = QemuVM(tmp_path, img, fmt)
        made.append(vm)
        return vm

    yield make
    for vm in made:
        vm.close()


@pytest.fixture
def runtime_dir(tmp_path: Path) -> str:
    return str(tmp_path / "run")


@pytest.mark.parametrize("granularity", [64 * KiB, 16 * KiB])
def test_raw_reports_exactly_the_blocks_written_over_rotations(vm_factory, runtime_dir, granularity) -> None:
    vm = vm_factory("raw")
    rounds = [
        [(0, 4 * KiB), (1 * MiB + 100, 200 * KiB), (63 * MiB, 1 * MiB)],
        [],
        [(5 * MiB - 1, 2), (7 * MiB, 64 * KiB), (9 * MiB + 3 * KiB, 70 * KiB)],
        [(0, 4 * KiB), (33 * MiB + 512, 512)],
    ]
    with SocketMonitor(str(vm.tool_socket)) as monitor:
        tracker = DirtyTracker(monitor, STORAGE_NODE, granularity=granularity, runtime_dir=runtime_dir)
        with tracker:
            assert os.stat(runtime_dir).st_mode & 0o777 == 0o700
            for ranges in rounds:
                for offset, length in ranges:
                    vm.hmp_write(offset, length)
                result = tracker.read()
                assert result.status is BitmapRead.OK
                assert result.extents.dtype == np.int64
                assert result.extents.tolist() == blocks(ranges, granularity)
                assert tracker.pending == ()
        assert os.listdir(runtime_dir) == []
    assert_nothing_left(vm.driver)


def _host_ranges(img: Path, guest: tuple[int, int]) -> list[tuple[int, int]]:
    """Host (file) offsets of a guest range, from qemu-img map."""
    offset, length = guest
    out = []
    for ext in qemu_img_map(img):
        lo, hi = max(ext["start"], offset), min(ext["start"] + ext["length"], offset + length)
        if lo < hi and ext.get("data"):
            host = ext["offset"] + lo - ext["start"]
            out.append((host, hi - lo))
    return out


def _covered(extents: list[list[int]], start: int, length: int) -> bool:
    return any(o <= start and start + length <= o + n for o, n in extents)


def _overlaps(extents: list[list[int]], start: int, length: int) -> bool:
    return any(o < start + length and start < o + n for o, n in extents)


def test_qcow2_reports_file_offsets(vm_factory, runtime_dir) -> None:
    vm = vm_factory("qcow2")
    g = 64 * KiB
    first = [(1 * MiB, 4 * KiB), (10 * MiB + 8 * KiB, 100 * KiB)]
    second = [(20 * MiB, 64 * KiB)]
    with SocketMonitor(str(vm.tool_socket)) as monitor, DirtyTracker(monitor, STORAGE_NODE, runtime_dir=runtime_dir) as t:
        # Cycle 1: new clusters. Their data (at file offsets qemu-img map
        # reports) is dirty; metadata (L2, refcounts) may be dirty too.
        for offset, length in first:
            vm.hmp_write(offset, length)
        one = t.read().extents.tolist()
        data1 = [h for r in first for h in _host_ranges(vm.image, r)]
        assert data1 and all(h[0] >= 3 * g for h in data1)  # past header/tables: really a file offset
        for host, length in data1:
            assert _covered(one, host - host % g, length), (host, one)
        size = vm.image.stat().st_size
        assert all(o + n <= size + g for o, n in one)

        # Cycle 2: one more new cluster; the clusters of cycle 1 were not
        # written again and must not show up.
        for offset, length in second:
            vm.hmp_write(offset, length)
        two = t.read().extents.tolist()
        for host, length in _host_ranges(vm.image, second[0]):
            assert _covered(two, host, length)
        for host, length in data1:
            assert not _overlaps(two, host, length)

        # Cycle 3: rewriting allocated clusters changes no metadata: exactly
        # the clusters' file blocks.
        vm.hmp_write(10 * MiB + 8 * KiB, 4 * KiB)
        vm.hmp_write(20 * MiB + 56 * KiB, 8 * KiB)
        host_a = _host_ranges(vm.image, (10 * MiB + 8 * KiB, 4 * KiB))
        host_b = _host_ranges(vm.image, (20 * MiB + 56 * KiB, 8 * KiB))
        three = t.read().extents.tolist()
        assert three == blocks(host_a + host_b, g)
    assert_nothing_left(vm.driver)


def test_a_qcow2_file_that_grows_while_its_bitmaps_are_read_keeps_qemu_alive(vm_factory, runtime_dir) -> None:
    """A guest write that allocates a cluster grows the storage node, and QEMU truncates every bitmap on it -
    asserting that none is busy: an NBD export of one makes it busy. Here the guest writes during each read."""
    from vmcache.host.nbdreader import read_dirty_extents

    vm = vm_factory("qcow2")
    grew: list[bool] = []

    def reader(*args, **kwargs):
        before = vm.image.stat().st_size
        vm.hmp_write(40 * MiB + len(grew) * MiB, 64 * KiB)  # a new cluster, while the bitmaps are exported
        grew.append(vm.image.stat().st_size > before)
        return read_dirty_extents(*args, **kwargs)

    with SocketMonitor(str(vm.tool_socket)) as monitor, \
            DirtyTracker(monitor, STORAGE_NODE, runtime_dir=runtime_dir, reader=reader) as t:
        for i in range(3):
            vm.hmp_write(i * MiB, 4 * KiB)
            assert t.read().status is BitmapRead.OK
        assert grew == [True] * 3  # the file did grow under each read
        last = _host_ranges(vm.image, (42 * MiB, 64 * KiB))
        later = t.read().extents.tolist()  # the cluster written during the last read is in the next one
        assert last and all(_covered(later, h - h % (64 * KiB), n) for h, n in last), (last, later)
    assert vm.proc is not None and vm.proc.poll() is None, vm.log.read_text()[-500:]
    assert_nothing_left(vm.driver)


def test_a_clean_period_is_read_without_an_nbd_server(vm_factory, runtime_dir) -> None:
    """QEMU's count of the rotated bitmap is 0: no server, view, merge or export - an idle disk's cycle."""
    vm = vm_factory("raw")
    with SocketMonitor(str(vm.tool_socket)) as monitor:
        sent: list[str] = []
        execute = monitor.execute

        def recording(command, arguments=None):
            sent.append(command)
            return execute(command, arguments)

        monitor.execute = recording  # type: ignore[method-assign]
        with DirtyTracker(monitor, STORAGE_NODE, runtime_dir=runtime_dir) as t:
            sent.clear()
            assert t.read().extents.tolist() == []
            assert "nbd-server-start" not in sent and "blockdev-add" not in sent, sent
            vm.hmp_write(3 * MiB, 4 * KiB)
            assert t.read().extents.tolist() == [[3 * MiB, 64 * KiB]]
            assert sent.count("nbd-server-start") == 1
    assert_nothing_left(vm.driver)


def test_stale_bitmaps_of_ours_are_removed_and_others_kept(vm_factory, runtime_dir) -> None:
    vm = vm_factory("raw")
    vm.driver("block-dirty-bitmap-add", node=STORAGE_NODE, name="vmcache-deadbeef-7", granularity=65536)
    vm.driver("block-dirty-bitmap-add", node=STORAGE_NODE, name="vmcache-deadbeef-8", disabled=True)
    vm.driver("block-dirty-bitmap-add", node=STORAGE_NODE, name="backup-full")
    with SocketMonitor(str(vm.tool_socket)) as monitor:
        tracker = DirtyTracker(monitor, STORAGE_NODE, runtime_dir=runtime_dir)
        tracker.start()
        names = {b.name for b in find_disk(discover_disks(monitor), node=STORAGE_NODE).bitmaps}
        assert names == {"backup-full", tracker.active}
        vm.hmp_write(0, 512)
        assert tracker.read().extents.tolist() == [[0, 65536]]
        tracker.stop()
    names = {b["name"] for n in vm.driver("query-named-block-nodes", flat=True) for b in n.get("dirty-bitmaps", [])}
    assert names == {"backup-full"}
    assert_nothing_left(vm.driver)


def test_a_bitmap_removed_under_the_tracker_is_replaced_and_tracking_goes_on(vm_factory, runtime_dir) -> None:
    """Someone else removes our recording bitmap (a second agent's stale sweep, an operator):
    that read fails and says so, a new bitmap records from then on, later reads are exact."""
    vm = vm_factory("raw")
    with SocketMonitor(str(vm.tool_socket)) as monitor:
        tracker = DirtyTracker(monitor, STORAGE_NODE, runtime_dir=runtime_dir)
        with tracker:
            vm.hmp_write(0, 4 * KiB)
            assert tracker.read().extents.tolist() == [[0, 65536]]
            lost = tracker.active
            vm.driver("block-dirty-bitmap-remove", node=STORAGE_NODE, name=lost)
            vm.hmp_write(1 * MiB, 4 * KiB)  # recorded by nobody: the bitmap is gone
            with pytest.raises(BitmapReadError, match="removed"):
                tracker.read()
            assert tracker.active not in (None, lost)
            vm.hmp_write(2 * MiB, 4 * KiB)
            result = tracker.read()
            assert result.status is BitmapRead.OK
            assert result.extents.tolist() == [[2 * MiB, 65536]]
            vm.hmp_write(3 * MiB, 4 * KiB)
            assert tracker.read().extents.tolist() == [[3 * MiB, 65536]]
        assert os.listdir(runtime_dir) == []
    assert_nothing_left(vm.driver)


def test_foreign_nbd_server_defers_and_loses_nothing(vm_factory, runtime_dir, tmp_path) -> None:
    vm = vm_factory("raw")
    foreign = str(tmp_path / "backup.nbd")
    with SocketMonitor(str(vm.tool_socket)) as monitor, DirtyTracker(monitor, STORAGE_NODE, runtime_dir=runtime_dir) as t:
        vm.hmp_write(0, 4 * KiB)
        # A "backup" (the way libvirt pulls one): its own server and export.
        vm.driver("nbd-server-start", addr={"type": "unix", "data": {"path": foreign}})
        vm.driver("block-export-add", type="nbd", id="backup-vda", name="vda", **{"node-name": FORMAT_NODE})
        vm.hmp_write(1 * MiB, 4 * KiB)
        first = t.read()
        assert first.status is BitmapRead.DEFERRED and "already running" in first.reason
        assert first.extents.shape == (0, 2)
        vm.hmp_write(2 * MiB, 4 * KiB)
        second = t.read()
        assert second.deferred
        assert len(t.pending) == 1  # merged into one bitmap while waiting
        # The backup was not touched.
        assert [e["id"] for e in vm.driver("query-block-exports")] == ["backup-vda"]
        assert os.path.exists(foreign)
        vm.driver("block-export-del", id="backup-vda")
        vm.driver("nbd-server-stop")
        vm.hmp_write(3 * MiB, 4 * KiB)
        third = t.read()
        assert third.status is BitmapRead.OK
        assert third.extents.tolist() == blocks([(0, 1), (1 * MiB, 1), (2 * MiB, 1), (3 * MiB, 1)], 65536)
        assert t.read().extents.tolist() == []
    assert_nothing_left(vm.driver)


def test_discovery_and_allow_list(vm_factory) -> None:
    vm = vm_factory("qcow2")
    with SocketMonitor(str(vm.tool_socket)) as monitor:
        disk = find_disk(discover_disks(monitor), file=str(vm.image))
        assert (disk.storage_node, disk.format_node, disk.format, disk.protocol) == (
            STORAGE_NODE,
            FORMAT_NODE,
            "qcow2",
            "file",
        )
        assert disk.eligible and not disk.direct and not disk.no_flush
        assert disk.qdev == QDEV and disk.device_id == DEVICE_ID
        assert find_disk([disk], node=FORMAT_NODE) is disk
        with pytest.raises(DiskNotFoundError):
            find_disk(discover_disks(monitor), node="nope")
        with pytest.raises(QMPCommandError) as err:
            monitor.execute("block-dirty-bitmap-add", {"node": "nope", "name": "vmcache-x"})
        assert err.value.error_class == "GenericError"
        with pytest.raises(CommandNotAllowedError):
            monitor.execute("quit")
        with pytest.raises(CommandNotAllowedError):
            hmp(monitor, "info block")
    assert vm.proc is not None and vm.proc.poll() is None  # "quit" never reached QEMU


def test_writes_command_json(vm_factory) -> None:
    vm = vm_factory("raw")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vmcache.cli", "writes", "--qmp", str(vm.tool_socket), "--file", str(vm.image)]
        + ["--interval", "1.5", "--count", "2", "--json", "--granularity", "4KiB"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # wait for the tracker's first bitmap
            nodes = vm.driver("query-named-block-nodes", flat=True)
            if any(b["name"].startswith(PREFIX) for n in nodes for b in n.get("dirty-bitmaps", [])):
                break
            time.sleep(0.05)
        vm.hmp_write(8192, 100)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    cycles = [json.loads(line) for line in out.splitlines()]
    assert [c["cycle"] for c in cycles] == [1, 2]
    assert cycles[0]["status"] == "ok" and cycles[0]["node"] == STORAGE_NODE
    assert cycles[0]["extents"] == [[8192, 4096]] and cycles[0]["bytes"] == 4096
    assert cycles[1]["extents"] == []
    assert_nothing_left(vm.driver)


def test_storage_daemon_over_socket(tmp_path, runtime_dir) -> None:
    img = image(tmp_path / "qsd.raw", "raw")
    with StorageDaemon(tmp_path, img, "raw") as qsd, SocketMonitor(str(qsd.tool_socket)) as monitor:
        disk = find_disk(discover_disks(monitor), file=str(img))
        assert disk.storage_node == STORAGE_NODE and disk.eligible
        with DirtyTracker(monitor, STORAGE_NODE, runtime_dir=runtime_dir) as t:
            qsd.start_writer()
            qsd.nbd_write([(0, 4 * KiB), (3 * MiB, 200 * KiB)])
            # The writer's NBD server is not ours: defer, don't touch it.
            assert t.read().deferred
            qsd.nbd_write([(50 * MiB, 1)])
            qsd.stop_writer()
            got = t.read()
            assert got.status is BitmapRead.OK
            assert got.extents.tolist() == blocks([(0, 4 * KiB), (3 * MiB, 200 * KiB), (50 * MiB, 1)], 65536)
            for _ in range(2):
                qsd.start_writer()
                qsd.nbd_write([(7 * MiB, 64 * KiB)])
                qsd.stop_writer()
                assert t.read().extents.tolist() == [[7 * MiB, 64 * KiB]]
        assert_nothing_left(qsd.driver)


# -- libvirt ----------------------------------------------------------------

DOMAIN_XML = """
<domain type='qemu'>
  <name>{name}</name>
  <memory unit='MiB'>32</memory>
  <vcpu>1</vcpu>
  <os><type arch='x86_64' machine='pc'>hvm</type></os>
  <devices>
    <emulator>/usr/bin/qemu-system-x86_64</emulator>
    <disk type='file' device='disk'>
      <driver name='qemu' type='raw' cache='writethrough'/>
      <source file='{image}'/>
      <target dev='vda' bus='virtio'/>
    </disk>
  </devices>
</domain>
"""


def _virsh_hmp(name: str, line: str) -> str:
    return subprocess.run(
        ["virsh", "-c", "qemu:///system", "qemu-monitor-command", name, "--hmp", line],
        check=True,
        capture_output=True,
        text=True,
    ).stdout


@pytest.fixture
def libvirt_domain(tmp_path) -> Iterator:
    libvirt = pytest.importorskip("libvirt")
    if shutil.which("virsh") is None:
        pytest.skip("no virsh")
    try:
        conn = libvirt.open("qemu:///system")
    except libvirt.libvirtError as err:
        pytest.skip(f"libvirtd not reachable: {err}")
    name = f"vmcache-test-{uuid.uuid4().hex[:8]}"
    img = image(Path("/var/lib/libvirt/images") / f"{name}.raw" if os.access("/var/lib/libvirt/images", os.W_OK) else tmp_path / "lv.raw", "raw")
    dom = conn.createXML(DOMAIN_XML.format(name=name, image=img), libvirt.VIR_DOMAIN_START_PAUSED)
    try:
        yield dom, name, img
    finally:
        try:
            dom.destroy()
        except libvirt.libvirtError:
            pass
        conn.close()
        img.unlink(missing_ok=True)


def test_libvirt_transport(libvirt_domain, runtime_dir) -> None:
    dom, name, img = libvirt_domain
    monitor = LibvirtMonitor(dom)
    disk = find_disk(discover_disks(monitor), file=str(img))
    assert disk.storage_node.endswith("-storage") and disk.format == "raw"
    assert disk.eligible and disk.qdev is not None
    with pytest.raises(QMPCommandError):
        monitor.execute("block-dirty-bitmap-remove", {"node": disk.storage_node, "name": "vmcache-missing"})
    with DirtyTracker(monitor, disk.storage_node, runtime_dir=runtime_dir) as t:
        for ranges in ([(0, 4 * KiB), (5 * MiB, 70 * KiB)], [(60 * MiB, 1)]):
            for offset, length in ranges:
                _virsh_hmp(name, f'qemu-io -d {disk.qdev} "write -P 0x5a {offset} {length}"')
            got = t.read()
            assert got.status is BitmapRead.OK
            assert got.extents.tolist() == blocks(ranges, 65536)
    nodes = monitor.execute("query-named-block-nodes", {"flat": True})
    assert not any(b["name"].startswith(PREFIX) for n in nodes for b in n.get("dirty-bitmaps", []))
    assert not any(n["node-name"].startswith(PREFIX) for n in nodes)
    assert monitor.execute("query-block-exports") == []


@pytest.fixture
def block_status_calls(monkeypatch) -> list[tuple[int, int]]:
    """Every NBD block_status request the reader sends, as ``(offset, count)``."""
    import nbd

    calls: list[tuple[int, int]] = []
    real = nbd.NBD.aio_block_status

    def counting(self, count, offset, *args, **kwargs):
        calls.append((offset, count))
        return real(self, count, offset, *args, **kwargs)

    monkeypatch.setattr(nbd.NBD, "aio_block_status", counting)
    return calls


def test_large_sparse_image_is_asked_only_where_it_holds_data(vm_factory, runtime_dir, block_status_calls) -> None:
    """4 TiB sparse raw: writes at its start, middle and end are reported exactly, with a request per place."""
    TiB = 1 << 40
    g = 64 * KiB
    vm = vm_factory("raw", "4T")
    rounds = [
        [(0, 4 * KiB), (2 * TiB + 100, 200 * KiB), (4 * TiB - MiB, MiB)],
        [(3 * TiB + 5 * MiB, 64 * KiB), (1 * MiB + 3, 10)],
    ]
    with SocketMonitor(str(vm.tool_socket)) as monitor, DirtyTracker(monitor, STORAGE_NODE, runtime_dir=runtime_dir) as t:
        written: list[tuple[int, int]] = []
        for ranges in rounds:
            block_status_calls.clear()
            for offset, length in ranges:
                vm.hmp_write(offset, length)
            written += ranges
            result = t.read()
            assert result.status is BitmapRead.OK
            assert result.extents.tolist() == blocks(ranges, g)
            # The whole disk would take 1024 requests of 4 GiB; the file holds data in a few places.
            places = len({offset // (1 << 30) for offset, _ in written})
            assert 1 <= len(block_status_calls) <= places, block_status_calls
            for offset, count in block_status_calls:
                assert count <= 1 << 30, (offset, count)
        # Zeroing QEMU does with fallocate leaves no data there (nothing of it is cached
        # either): not asked, not reported. The 1 MiB write beside it is.
        vm.hmp_write(4 * TiB - MiB, MiB)
        zeroed = vm.driver("human-monitor-command", **{"command-line": f'qemu-io -d {QDEV} "write -z {2 * TiB} {MiB}"'})
        assert "wrote" in zeroed or not zeroed.strip(), zeroed
        assert t.read().extents.tolist() == [[4 * TiB - MiB, MiB]]
    assert_nothing_left(vm.driver)
