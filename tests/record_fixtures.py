"""Re-record ``qmp_fixtures/*.json`` from a real QEMU 7.2 (``make fixtures``).

Each scenario runs vmcache's own code (discovery, DirtyTracker) against a
real qemu-system-x86_64 or qemu-storage-daemon through a recording wrapper
of its monitor, while the test side writes through a second QMP socket.
Every command vmcache sent and QEMU's reply is kept, with the dirty extents
the NBD reader got, in order. Run-specific values are replaced by tokens
(``@WORKDIR@``, ``@SESSION@``), ids dropped (the fake echoes the client's),
and every file is validated before it is written.

    python -m tests.record_fixtures            # record all, validate, write
    python -m tests.record_fixtures --check    # validate the files in the repo
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tests.fakeqmp import FIXTURES, Normaliser
from tests.qemu_helpers import FORMAT_NODE, QEMU_IMG, STORAGE_NODE, QemuVM, StorageDaemon, image
from vmcache.errors import BitmapReadError, QMPCommandError
from vmcache.host.blockdev import discover_disks
from vmcache.host.nbdreader import read_dirty_extents
from vmcache.host.qmp import ALLOWED_COMMANDS, SocketMonitor
from vmcache.host.tracker import DirtyTracker

KiB = 1024
MiB = 1024 * KiB
TOKENS = ("@WORKDIR@", "@SESSION@")


class Recorder:
    """Wraps a Monitor and the NBD reader; keeps every step."""

    def __init__(self, monitor: SocketMonitor) -> None:
        self.monitor = monitor
        self.steps: list[dict[str, Any]] = []
        self.fail_reads = 0

    def execute(self, command: str, arguments: Mapping[str, Any] | None = None) -> Any:
        sent: dict[str, Any] = {"execute": command}
        if arguments:
            sent["arguments"] = json.loads(json.dumps(arguments))
        try:
            result = self.monitor.execute(command, arguments)
        except QMPCommandError as err:
            self.steps.append({"command": sent, "reply": {"error": {"class": err.error_class, "desc": err.desc}}})
            raise
        self.steps.append({"command": sent, "reply": {"return": result}})
        return result

    def close(self) -> None:
        self.monitor.close()

    def reader(self, socket_path: str, export: str, bitmaps: list[str], length: int, *, timeout: float,
               ranges: Any = None) -> Any:
        if self.fail_reads:
            # A client-side failure (the NBD connection dropped, say): QEMU
            # then sees the tracker's cleanup, recorded as it happens.
            self.fail_reads -= 1
            error = "simulated NBD client failure"
            self.steps.append({"nbd": {"export": export, "bitmaps": list(bitmaps), "length": length}, "error": error})
            raise BitmapReadError(error)
        extents = read_dirty_extents(socket_path, export, bitmaps, length, timeout=timeout, ranges=ranges)
        self.steps.append(
            {"nbd": {"export": export, "bitmaps": list(bitmaps), "length": length}, "extents": extents.tolist()}
        )
        return extents


# -- scenarios: (description, kind, format, body(process, recorder, workdir) -> session or None) ----


def _tracker(rec: Recorder, workdir: Path) -> DirtyTracker:
    return DirtyTracker(rec, STORAGE_NODE, runtime_dir=str(workdir / "run"), reader=rec.reader)


def discovery(proc: Any, rec: Recorder, workdir: Path) -> str | None:
    discover_disks(rec)
    return None


def tracker_cycles(proc: Any, rec: Recorder, workdir: Path) -> str | None:
    """start; write; read; read (nothing); write; read; stop."""
    t = _tracker(rec, workdir)
    t.start()
    proc.hmp_write(0, 4 * KiB)
    proc.hmp_write(1 * MiB + 100, 200 * KiB)
    t.read()
    t.read()
    proc.hmp_write(63 * MiB, 1 * MiB)
    t.read()
    t.stop()
    return t.session


def tracker_deferred(proc: Any, rec: Recorder, workdir: Path) -> str | None:
    """A foreign NBD server (a backup) runs across two reads: deferred, merged, then read."""
    t = _tracker(rec, workdir)
    t.start()
    proc.hmp_write(0, 4 * KiB)
    proc.driver("nbd-server-start", addr={"type": "unix", "data": {"path": str(workdir / "backup.nbd")}})
    proc.driver("block-export-add", type="nbd", id="backup-vda", name="vda", **{"node-name": FORMAT_NODE})
    t.read()
    proc.hmp_write(2 * MiB, 4 * KiB)
    t.read()
    proc.driver("block-export-del", id="backup-vda")
    proc.driver("nbd-server-stop")
    proc.hmp_write(3 * MiB, 4 * KiB)
    t.read()
    t.stop()
    return t.session


def tracker_read_failure(proc: Any, rec: Recorder, workdir: Path) -> str | None:
    """The first read fails on the client side: the bitmap is kept and read with the next period's."""
    t = _tracker(rec, workdir)
    t.start()
    proc.hmp_write(0, 4 * KiB)
    rec.fail_reads = 1
    try:
        t.read()
    except BitmapReadError:
        pass
    proc.hmp_write(5 * MiB, 4 * KiB)
    t.read()
    t.stop()
    return t.session


def tracker_stale(proc: Any, rec: Recorder, workdir: Path) -> str | None:
    """Bitmaps of a crashed agent (ours by prefix) and someone else's on the node."""
    proc.driver("block-dirty-bitmap-add", node=STORAGE_NODE, name="vmcache-deadbeef-7")
    proc.driver("block-dirty-bitmap-add", node=STORAGE_NODE, name="vmcache-deadbeef-8", disabled=True)
    proc.driver("block-dirty-bitmap-add", node=STORAGE_NODE, name="backup-full")
    t = _tracker(rec, workdir)
    t.start()
    t.stop()
    return t.session


def monitor_errors(proc: Any, rec: Recorder, workdir: Path) -> str | None:
    """QEMU's error replies: unknown node, no NBD server, unknown export."""
    for command, arguments in (
        ("block-dirty-bitmap-add", {"node": "nope", "name": "vmcache-x"}),
        ("nbd-server-stop", None),
        ("block-export-del", {"id": "vmcache-none"}),
    ):
        try:
            rec.execute(command, arguments)
        except QMPCommandError:
            pass
    return None


def qsd_writes(proc: StorageDaemon, rec: Recorder, workdir: Path) -> str | None:
    """qemu-storage-daemon: writes through its own (foreign) NBD export, then read."""
    discover_disks(rec)
    t = _tracker(rec, workdir)
    t.start()
    proc.start_writer()
    proc.nbd_write([(0, 4 * KiB), (3 * MiB, 200 * KiB)])
    t.read()
    proc.stop_writer()
    t.read()
    t.stop()
    return t.session


SCENARIOS: dict[str, tuple[str, str, str, Callable[..., str | None]]] = {
    "discovery-vm-raw": ("discover_disks on a paused VM, raw writethrough disk", "vm", "raw", discovery),
    "discovery-vm-qcow2": ("discover_disks on a paused VM, qcow2 writethrough disk", "vm", "qcow2", discovery),
    "discovery-vm-chain": ("discover_disks on a paused VM, qcow2 writethrough overlay over a read-only raw base",
                           "vm", "chain", discovery),
    "tracker-cycles-raw": (tracker_cycles.__doc__ or "", "vm", "raw", tracker_cycles),
    "tracker-cycles-qcow2": (tracker_cycles.__doc__ or "", "vm", "qcow2", tracker_cycles),
    "tracker-deferred": (tracker_deferred.__doc__ or "", "vm", "raw", tracker_deferred),
    "tracker-read-failure": (tracker_read_failure.__doc__ or "", "vm", "raw", tracker_read_failure),
    "tracker-stale": (tracker_stale.__doc__ or "", "vm", "raw", tracker_stale),
    "monitor-errors": (monitor_errors.__doc__ or "", "vm", "raw", monitor_errors),
    "qsd-writes": (qsd_writes.__doc__ or "", "qsd", "raw", qsd_writes),
}


def record(name: str) -> dict[str, Any]:
    """Run one scenario against real QEMU; the normalised fixture."""
    description, kind, fmt, body = SCENARIOS[name]
    with tempfile.TemporaryDirectory(prefix="vmcache-rec-") as tmp:
        workdir = Path(tmp)
        base = image(workdir / "base.raw", "raw") if fmt == "chain" else None
        img = _image(workdir, fmt, base)
        proc_ = QemuVM(workdir, img, "qcow2", backing=base) if base else (
            QemuVM if kind == "vm" else StorageDaemon)(workdir, img, fmt)
        with proc_ as proc:
            assert proc.driver._client.greeting is not None
            greeting = proc.driver._client.greeting._asdict()
            version = proc.driver("query-version")
            rec = Recorder(SocketMonitor(str(proc.tool_socket)))
            try:
                session = body(proc, rec, workdir)
            finally:
                rec.close()
        norm = Normaliser({"@WORKDIR@": str(workdir)})
        if session:
            norm.bind("@SESSION@", session)
        q = version["qemu"]
        return {
            "description": " ".join(description.split()),
            "recorded_with": {
                "program": "qemu-system-x86_64" if kind == "vm" else "qemu-storage-daemon",
                "qemu": f"{q['major']}.{q['minor']}.{q['micro']}",
                "package": version["package"],
                "image_format": fmt,
            },
            "greeting": greeting,
            "exchanges": norm.normalise(rec.steps),
        }


def _image(workdir: Path, fmt: str, base: Path | None) -> Path:
    """The scenario's image: ``fmt`` itself, or a qcow2 overlay over ``base`` for a chain."""
    if base is None:
        return image(workdir / f"disk.{fmt}", fmt)
    path = workdir / "disk.qcow2"
    subprocess.run([QEMU_IMG, "create", "-q", "-f", "qcow2", "-b", str(base), "-F", "raw", str(path)], check=True)
    return path


_RAW_TMP = re.compile(r"/tmp/vmcache-rec-|/tmp/tmp")


def validate(fixture: Mapping[str, Any]) -> list[str]:
    """Problems with a fixture (empty when it is fit to replay)."""
    problems = []
    for key in ("description", "recorded_with", "greeting", "exchanges"):
        if key not in fixture:
            problems.append(f"missing {key}")
    if "QMP" not in fixture.get("greeting", {}):
        problems.append("greeting has no QMP member")
    for i, step in enumerate(fixture.get("exchanges", [])):
        if "command" in step:
            command = step["command"]
            if command.get("execute") not in ALLOWED_COMMANDS:
                problems.append(f"step {i}: {command.get('execute')} is not on the allow-list")
            reply = step.get("reply", {})
            if len(set(reply) & {"return", "error"}) != 1 or set(reply) - {"return", "error"}:
                problems.append(f"step {i}: reply must hold exactly one of return/error: {sorted(reply)}")
        elif "nbd" in step:
            if set(step["nbd"]) != {"export", "bitmaps", "length"} or not (
                isinstance(step.get("error"), str)
                or all(isinstance(e, list) and len(e) == 2 for e in step.get("extents", [None]))
            ):
                problems.append(f"step {i}: malformed nbd step")
        else:
            problems.append(f"step {i}: neither command nor nbd")
    text = json.dumps(fixture)
    if _RAW_TMP.search(text):
        problems.append("a temporary path was not normalised")
    if '"timestamp"' in text or '"__qmp#' in text:
        problems.append("ids or timestamps left in")
    return problems


def dump(fixture: Mapping[str, Any]) -> str:
    return json.dumps(fixture, indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only validate the fixtures in the repo")
    parser.add_argument("names", nargs="*", help=f"scenarios (default all: {', '.join(SCENARIOS)})")
    args = parser.parse_args(argv)
    names = args.names or list(SCENARIOS)
    bad = 0
    for name in names:
        path = FIXTURES / f"{name}.json"
        fixture = json.loads(path.read_text()) if args.check else record(name)
        problems = validate(fixture)
        if problems:
            bad += 1
            print(f"{name}: INVALID: {'; '.join(problems)}", file=sys.stderr)
            continue
        if not args.check:
            path.write_text(dump(fixture))
        print(f"{name}: ok ({len(fixture['exchanges'])} steps)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
