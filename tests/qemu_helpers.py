"""Real QEMU processes for live tests, killed reliably at teardown.

``QemuVM``: qemu-system-x86_64, paused (``-S``, TCG), one virtio-blk disk
opened writethrough (``cache.direct=off``, ``write-cache=off``) as a
storage node ``disk0-storage`` under a format node ``disk0-format``, and
TWO ``-qmp`` sockets: QEMU serves one client per socket, so the tool under
test holds ``tool_socket`` while the test drives QEMU through
``driver_socket`` (``hmp_write`` runs HMP ``qemu-io`` there).

``StorageDaemon``: qemu-storage-daemon with the same nodes and two
monitors; it has no guest device, so ``nbd_write`` writes through a
writable NBD export that it adds and removes around the write.

Both are context managers; ``close()`` kills the process group and
removes the sockets. ``image()`` makes a small raw or qcow2 image.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Self

__all__ = [
    "QEMU",
    "QSD",
    "STORAGE_NODE",
    "FORMAT_NODE",
    "DEVICE_ID",
    "have_qemu",
    "image",
    "qemu_img_map",
    "QmpDriver",
    "QemuVM",
    "StorageDaemon",
]

QEMU = shutil.which("qemu-system-x86_64") or "/usr/bin/qemu-system-x86_64"
QSD = shutil.which("qemu-storage-daemon") or "/usr/bin/qemu-storage-daemon"
QEMU_IMG = shutil.which("qemu-img") or "/usr/bin/qemu-img"
STORAGE_NODE = "disk0-storage"
FORMAT_NODE = "disk0-format"
DEVICE_ID = "disk0"
BASE_STORAGE_NODE = "base0-storage"
BASE_FORMAT_NODE = "base0-format"
QDEV = f"/machine/peripheral/{DEVICE_ID}/virtio-backend"


def have_qemu() -> bool:
    return os.access(QEMU, os.X_OK) and os.access(QEMU_IMG, os.X_OK)


def image(path: Path, fmt: str, size: str = "64M") -> Path:
    """Create an empty image of ``fmt`` (raw or qcow2)."""
    subprocess.run([QEMU_IMG, "create", "-q", "-f", fmt, str(path), size], check=True)
    return path


def qemu_img_map(path: Path) -> list[dict[str, Any]]:
    """``qemu-img map --output=json -U`` (the image may be open in QEMU)."""
    out = subprocess.run(
        [QEMU_IMG, "map", "--output=json", "-U", str(path)], check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out)


def _wait_for_sockets(proc: subprocess.Popen[bytes], paths: list[Path], log: Path, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"QEMU exited {proc.returncode}: {log.read_text(errors='replace')[-2000:]}")
        if all(p.exists() for p in paths):
            return
        time.sleep(0.02)
    raise RuntimeError(f"QEMU sockets did not appear in {timeout}s: {log.read_text(errors='replace')[-2000:]}")


class QmpDriver:
    """A plain synchronous QMP client for the test side (no allow-list)."""

    def __init__(self, path: Path, timeout: float = 20.0) -> None:
        from qemu.qmp import QMPClient

        self._loop = asyncio.new_event_loop()
        self._client = QMPClient("test-driver")
        self.timeout = timeout
        self._run(self._client.connect(str(path)))

    def _run(self, coro: Any) -> Any:
        return self._loop.run_until_complete(asyncio.wait_for(coro, self.timeout))

    def __call__(self, command: str, **arguments: Any) -> Any:
        return self._run(self._client.execute(command, arguments or None))

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._run(self._client.disconnect())
        finally:
            self._loop.close()


class _Process:
    """A QEMU-ish process in its own session, with two QMP sockets."""

    kind = "qemu"

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.tool_socket = workdir / f"{self.kind}-tool.qmp"
        self.driver_socket = workdir / f"{self.kind}-driver.qmp"
        self.log = workdir / f"{self.kind}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._driver: QmpDriver | None = None

    def _spawn(self, argv: list[str]) -> None:
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            _wait_for_sockets(self.proc, [self.tool_socket, self.driver_socket], self.log)
        except BaseException:
            self.close()
            raise

    @property
    def driver(self) -> QmpDriver:
        """The test's own QMP connection (on ``driver_socket``)."""
        if self._driver is None:
            self._driver = QmpDriver(self.driver_socket)
        return self._driver

    def close(self) -> None:
        if self._driver is not None:
            try:
                self._driver.close()
            except Exception:  # noqa: BLE001 - teardown must go on
                pass
            self._driver = None
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=5)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=5)
        for path in (self.tool_socket, self.driver_socket):
            try:
                path.unlink()
            except FileNotFoundError:
                pass

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class QemuVM(_Process):
    """qemu-system-x86_64 paused, with ``image_path`` as a writethrough virtio-blk disk."""

    kind = "vm"

    def __init__(self, workdir: Path, image_path: Path, fmt: str, *, backing: Path | None = None) -> None:
        """``backing``: a raw image under a qcow2 ``image_path``, opened read-only as its own node pair
        (the way libvirt's -blockdev opens a backing chain)."""
        super().__init__(workdir)
        self.image = image_path
        self.fmt = fmt
        chain = [] if backing is None else [
            "-blockdev",
            f"driver=file,node-name={BASE_STORAGE_NODE},filename={backing},cache.direct=off,cache.no-flush=off,"
            "read-only=on",
            "-blockdev", f"driver=raw,node-name={BASE_FORMAT_NODE},file={BASE_STORAGE_NODE},read-only=on",
        ]
        top_backing = f",backing={BASE_FORMAT_NODE}" if backing is not None else ""
        self._spawn(
            [
                QEMU,
                "-S",
                "-nodefaults",
                "-display",
                "none",
                "-machine",
                "pc,accel=tcg",
                "-m",
                "32",
                *chain,
                "-blockdev",
                f"driver=file,node-name={STORAGE_NODE},filename={image_path},cache.direct=off,cache.no-flush=off",
                "-blockdev",
                f"driver={fmt},node-name={FORMAT_NODE},file={STORAGE_NODE},cache.direct=off{top_backing}",
                "-device",
                f"virtio-blk-pci,drive={FORMAT_NODE},id={DEVICE_ID},write-cache=off",
                "-qmp",
                f"unix:{self.tool_socket},server=on,wait=off",
                "-qmp",
                f"unix:{self.driver_socket},server=on,wait=off",
            ]
        )

    def hmp_write(self, offset: int, length: int, pattern: int = 0xAB) -> None:
        """A guest-like write through the device (HMP ``qemu-io``)."""
        line = f'qemu-io -d {QDEV} "write -P {pattern:#x} {offset} {length}"'
        out = self.driver("human-monitor-command", **{"command-line": line})
        if "wrote" not in out and out.strip():
            raise RuntimeError(f"qemu-io: {out}")


class StorageDaemon(_Process):
    """qemu-storage-daemon serving ``image_path`` (no device, two monitors)."""

    kind = "qsd"

    def __init__(self, workdir: Path, image_path: Path, fmt: str) -> None:
        super().__init__(workdir)
        self.image = image_path
        self.fmt = fmt
        self.nbd_socket = workdir / "qsd-writer.nbd"
        self._spawn(
            [
                QSD,
                "--blockdev",
                f"driver=file,node-name={STORAGE_NODE},filename={image_path},cache.direct=off",
                "--blockdev",
                f"driver={fmt},node-name={FORMAT_NODE},file={STORAGE_NODE}",
                "--chardev",
                f"socket,id=m0,path={self.tool_socket},server=on,wait=off",
                "--monitor",
                "chardev=m0",
                "--chardev",
                f"socket,id=m1,path={self.driver_socket},server=on,wait=off",
                "--monitor",
                "chardev=m1",
            ]
        )

    def start_writer(self) -> None:
        """Start QSD's NBD server with a writable export of the format node."""
        self.driver("nbd-server-start", addr={"type": "unix", "data": {"path": str(self.nbd_socket)}})
        self.driver("block-export-add", type="nbd", id="writer", name="writer", **{"node-name": FORMAT_NODE}, writable=True)

    def stop_writer(self) -> None:
        self.driver("block-export-del", id="writer", mode="hard")
        self.driver("nbd-server-stop")

    def nbd_write(self, ranges: list[tuple[int, int]], pattern: int = 0xAB) -> None:
        """Write each ``(offset, length)`` through the writer export (start_writer first)."""
        import nbd

        handle = nbd.NBD()
        handle.set_export_name("writer")
        handle.connect_unix(str(self.nbd_socket))
        for offset, length in ranges:
            handle.pwrite(bytes([pattern]) * length, offset)
        handle.flush()
        handle.shutdown()
