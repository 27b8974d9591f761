"""Monitor transports and disk discovery, against QMP recorded from QEMU 7.2."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest

from tests.fakeqmp import FIXTURES, FakeQMP, Normaliser, load_fixture
from tests.record_fixtures import validate
from vmcache.errors import CommandNotAllowedError, DiskNotFoundError, MonitorConnectionError, QMPCommandError
from vmcache.host.blockdev import backing_files, chain_layers, discover_disks, find_disk, parse_disks
from vmcache.host.qmp import ALLOWED_COMMANDS, TEST_COMMANDS, LibvirtMonitor, SocketMonitor, check_command, hmp


@pytest.fixture
def replay(tmp_path: Path):
    fakes: list[FakeQMP] = []

    def start(name: str) -> tuple[FakeQMP, SocketMonitor]:
        fake = FakeQMP(name, tmp_path / f"{name}.qmp", Normaliser({"@WORKDIR@": str(tmp_path)}))
        fakes.append(fake)
        return fake, SocketMonitor(str(fake.socket_path), timeout=5)

    yield start
    for fake in fakes:
        fake.close()


def test_every_fixture_is_valid_and_recorded_from_qemu_7_2() -> None:
    names = sorted(p.name for p in FIXTURES.glob("*.json"))
    assert len(names) >= 9
    for name in names:
        fixture = json.loads((FIXTURES / name).read_text())
        assert validate(fixture) == [], name
        assert fixture["recorded_with"]["qemu"].startswith("7.2."), name


def test_allow_list() -> None:
    check_command("query-named-block-nodes", None, ALLOWED_COMMANDS)
    with pytest.raises(CommandNotAllowedError, match="quit"):
        check_command("quit", None, ALLOWED_COMMANDS)
    with pytest.raises(CommandNotAllowedError, match="transaction/blockdev-snapshot-sync"):
        check_command("transaction", {"actions": [{"type": "blockdev-snapshot-sync", "data": {}}]}, ALLOWED_COMMANDS)
    with pytest.raises(CommandNotAllowedError):
        check_command("human-monitor-command", {"command-line": "info block"}, ALLOWED_COMMANDS)
    check_command("human-monitor-command", {"command-line": "info block"}, TEST_COMMANDS)


def test_refused_command_never_reaches_qemu(replay) -> None:
    fake, monitor = replay("monitor-errors")
    with pytest.raises(CommandNotAllowedError):
        monitor.execute("quit")
    with pytest.raises(CommandNotAllowedError):
        hmp(monitor, 'qemu-io -d x "write 0 1"')
    assert fake.cursor == 0
    # Now play the recording, so the fake is satisfied.
    for _ in range(3):
        with pytest.raises(QMPCommandError):
            monitor.execute(*_recorded_call(fake))
    monitor.close()


def _recorded_call(fake: FakeQMP) -> tuple[str, dict | None]:
    command = fake.exchanges[fake.cursor]["command"]
    return command["execute"], command.get("arguments")


def test_socket_monitor_translates_qemu_errors(replay) -> None:
    from qemu.qmp import ExecuteError

    fake, monitor = replay("monitor-errors")
    with monitor:
        with pytest.raises(QMPCommandError) as err:
            monitor.execute("block-dirty-bitmap-add", {"node": "nope", "name": "vmcache-x"})
        assert err.value.command == "block-dirty-bitmap-add"
        assert err.value.error_class == "GenericError"
        assert "nope" in err.value.desc
        assert isinstance(err.value.__cause__, ExecuteError)
        with pytest.raises(QMPCommandError, match="NBD server not running"):
            monitor.execute("nbd-server-stop")
        with pytest.raises(QMPCommandError, match="not found"):
            monitor.execute("block-export-del", {"id": "vmcache-none"})


def test_fake_fails_the_test_on_an_unexpected_command(tmp_path: Path) -> None:
    fake = FakeQMP("monitor-errors", tmp_path / "f.qmp", Normaliser())
    with SocketMonitor(fake.socket_path, timeout=5) as monitor:
        with pytest.raises(QMPCommandError, match="fakeqmp: unexpected"):
            monitor.execute("query-block")
    with pytest.raises(AssertionError, match="expected command"):
        fake.close()


def test_fake_fails_the_test_when_steps_are_left(tmp_path: Path) -> None:
    fake = FakeQMP("discovery-vm-raw", tmp_path / "f.qmp", Normaliser({"@WORKDIR@": str(tmp_path)}))
    with SocketMonitor(fake.socket_path, timeout=5) as monitor:
        monitor.execute("query-named-block-nodes", {"flat": True})
    with pytest.raises(AssertionError, match="never reached"):
        fake.close()


def test_connection_refused_and_timeouts(tmp_path: Path) -> None:
    with pytest.raises(MonitorConnectionError, match="cannot connect") as err:
        SocketMonitor(str(tmp_path / "missing.qmp"), timeout=1).connect()
    assert err.value.__cause__ is not None

    # A server that accepts and never greets: bounded by the timeout.
    path = str(tmp_path / "silent.qmp")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    held: list[socket.socket] = []
    thread = threading.Thread(target=lambda: held.append(server.accept()[0]), daemon=True)
    thread.start()
    started = time.monotonic()
    with pytest.raises(MonitorConnectionError):
        SocketMonitor(path, timeout=0.5).connect()
    assert time.monotonic() - started < 5
    for conn in held:
        conn.close()
    server.close()


@pytest.mark.parametrize(
    ("name", "fmt", "qdev"),
    [("discovery-vm-raw", "raw", "/machine/peripheral/disk0/virtio-backend"),
     ("discovery-vm-qcow2", "qcow2", "/machine/peripheral/disk0/virtio-backend")],
)
def test_discovery_from_recorded_vm(replay, tmp_path: Path, name: str, fmt: str, qdev: str) -> None:
    fake, monitor = replay(name)
    with monitor:
        disks = discover_disks(monitor)
    assert len(disks) == 1
    disk = disks[0]
    assert disk.filename == str(tmp_path / f"disk.{fmt}")
    assert (disk.storage_node, disk.format_node, disk.format, disk.protocol) == (
        "disk0-storage",
        "disk0-format",
        fmt,
        "file",
    )
    assert disk.eligible and not disk.no_flush and disk.bitmaps == ()
    assert disk.qdev == qdev and disk.device_id == "disk0"
    assert disk.size > 0
    assert find_disk(disks, file=disk.filename) is disk
    assert find_disk(disks, node="disk0-format") is disk
    with pytest.raises(DiskNotFoundError, match="disk0-storage="):
        find_disk(disks, node="libvirt-9-storage")


def test_discovery_of_a_backing_chain_from_recorded_vm(replay, tmp_path: Path) -> None:
    fake, monitor = replay("discovery-vm-chain")
    with monitor:
        disks = discover_disks(monitor)
    top = find_disk(disks, node="disk0-format")
    base = find_disk(disks, node="base0-format")
    assert top.filename == str(tmp_path / "disk.qcow2") and top.format == "qcow2"
    assert top.backing == (str(tmp_path / "base.raw"),) and top.device_id == "disk0"
    assert base.storage_node == "base0-storage" and base.format == "raw" and base.qdev is None
    assert base.backing == () and base.eligible
    assert chain_layers(disks, top) == [base]
    assert chain_layers(disks, base) == []


def test_backing_files_stop_at_a_json_filename_and_chains_shrink_with_a_pull() -> None:
    fixture = load_fixture("discovery-vm-chain")
    block = fixture["exchanges"][1]["reply"]["return"]
    inserted = block[0]["inserted"]
    assert backing_files(inserted) == ("@WORKDIR@/base.raw",)
    inserted["image"]["backing-image"]["backing-image"] = {"filename": "json:{\"driver\": \"nbd\"}"}
    assert backing_files(inserted) == ("@WORKDIR@/base.raw",)
    del inserted["image"]["backing-image"]
    assert backing_files(inserted) == ()
    nodes = fixture["exchanges"][0]["reply"]["return"]
    for node in nodes:
        if node["node-name"] == "base0-storage":
            node["cache"]["direct"] = True
    disks = parse_disks(nodes, load_fixture("discovery-vm-chain")["exchanges"][1]["reply"]["return"])
    top = find_disk(disks, node="disk0-format")
    assert [d.eligible for d in chain_layers(disks, top)] == [False]  # O_DIRECT base: the caller skips it


def test_discovery_direct_io_disks_are_not_eligible() -> None:
    fixture = load_fixture("discovery-vm-raw")
    nodes = fixture["exchanges"][0]["reply"]["return"]
    for node in nodes:
        node["cache"]["direct"] = True
    (disk,) = parse_disks(nodes, fixture["exchanges"][1]["reply"]["return"])
    assert disk.direct and not disk.eligible


def test_discovery_on_storage_daemon_has_no_device() -> None:
    steps = load_fixture("qsd-writes")["exchanges"]
    (disk,) = parse_disks(steps[0]["reply"]["return"], steps[1]["reply"]["return"])
    assert disk.storage_node == "disk0-storage" and disk.qdev is None and disk.device_id is None


class _FakeLibvirt:
    """libvirt_qemu.qemuMonitorCommand answering from a recording (libvirt passes QEMU's reply through)."""

    def __init__(self, steps: list[dict]) -> None:
        self.steps = list(steps)
        self.sent: list[dict] = []

    def __call__(self, domain: object, text: str, flags: int) -> str:
        self.sent.append(json.loads(text))
        return json.dumps(dict(self.steps.pop(0)["reply"], id="libvirt-42"))


def test_libvirt_monitor_translates_errors(monkeypatch) -> None:
    import libvirt
    import libvirt_qemu

    steps = load_fixture("monitor-errors")["exchanges"]
    fake = _FakeLibvirt(steps)
    monkeypatch.setattr(libvirt_qemu, "qemuMonitorCommand", fake)
    monitor = LibvirtMonitor(object())
    with pytest.raises(QMPCommandError) as err:
        monitor.execute("block-dirty-bitmap-add", {"node": "nope", "name": "vmcache-x"})
    assert err.value.error_class == "GenericError"
    assert fake.sent[0] == steps[0]["command"]
    with pytest.raises(CommandNotAllowedError):
        monitor.execute("system_reset")
    assert len(fake.sent) == 1

    def broken(domain: object, text: str, flags: int) -> str:
        raise libvirt.libvirtError("Requested operation is not valid: domain is not running")

    monkeypatch.setattr(libvirt_qemu, "qemuMonitorCommand", broken)
    with pytest.raises(MonitorConnectionError, match="not running") as err2:
        monitor.execute("query-block")
    assert isinstance(err2.value.__cause__, libvirt.libvirtError)


def test_libvirt_monitor_returns_the_return_value(monkeypatch) -> None:
    import libvirt_qemu

    steps = load_fixture("discovery-vm-qcow2")["exchanges"]
    monkeypatch.setattr(libvirt_qemu, "qemuMonitorCommand", _FakeLibvirt(steps))
    (disk,) = discover_disks(LibvirtMonitor(object()))
    assert disk.format == "qcow2"


def test_hmp_reports_errors_as_exceptions() -> None:
    class Echo:
        def __init__(self, text: str) -> None:
            self.text = text

        def execute(self, command: str, arguments=None):
            check_command(command, arguments, TEST_COMMANDS)
            return self.text

        def close(self) -> None:
            pass

    assert hmp(Echo("wrote 512/512 bytes at offset 0\n"), "qemu-io ...").startswith("wrote")
    with pytest.raises(QMPCommandError, match="Device 'x' not found"):
        hmp(Echo("Error: Device 'x' not found\r\n"), "qemu-io ...")


def test_two_disks_on_one_file_keep_their_own_node_pairs_and_devices():
    """query-named-block-nodes / query-block of a libvirt 9.0 domain with vdb and vdc <shareable/> on one file
    (as QEMU 7.2 answered, trimmed to the fields parse_disks reads)."""
    cache = {"no-flush": False, "direct": False, "writeback": True}
    nodes = [{"node-name": f"libvirt-{n}-{kind}", "drv": drv, "file": path, "cache": cache, "image": {"virtual-size": 1}}
             for n, path in ((1, "/i/b.raw"), (2, "/i/b.raw"), (3, "/i/a.raw"))
             for kind, drv in (("format", "raw"), ("storage", "file"))]
    block = [{"qdev": f"/machine/peripheral/ua-{dev}/virtio-backend", "inserted": {"node-name": f"libvirt-{n}-format"}}
             for dev, n in (("vda", 3), ("vdb", 2), ("vdc", 1))]
    disks = {d.storage_node: d for d in parse_disks(nodes, block)}
    assert {n: (d.format_node, d.device_id) for n, d in disks.items()} == {
        "libvirt-1-storage": ("libvirt-1-format", "ua-vdc"),
        "libvirt-2-storage": ("libvirt-2-format", "ua-vdb"),
        "libvirt-3-storage": ("libvirt-3-format", "ua-vda"),
    }
