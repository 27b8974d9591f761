"""``vmcache writes``: print each cycle's guest writes to one disk.

Talks QMP on a socket (plain QEMU or qemu-storage-daemon), tracks the
disk's storage node with a DirtyTracker and prints the dirty extents of
every cycle, in image-file offsets. ``--json``: one object per line and
cycle, ``extents`` as ``[offset, length]`` pairs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from ..errors import ConfigError
from ..host.blockdev import discover_disks, find_disk
from ..host.qmp import SocketMonitor
from ..host.tracker import DEFAULT_GRANULARITY, DirtyTracker
from ..model.extents import DirtyRead
from ..logfmt import event
from ..units import format_size
from ._args import duration_arg, size_arg

NAME = "writes"
HELP = "print the guest's writes to a disk each cycle (QEMU dirty bitmap over QMP)"

_log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--qmp", required=True, metavar="SOCKET", help="QMP unix socket of QEMU or qemu-storage-daemon")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--node", help="block node name (storage or format node of the disk)")
    which.add_argument("--file", metavar="IMAGE", help="image file of the disk")
    parser.add_argument("--interval", type=duration_arg, default=5.0, metavar="S", help="cycle length (default 5s)")
    parser.add_argument("--count", type=int, default=0, metavar="N", help="stop after N cycles (default: run until ^C)")
    parser.add_argument("--json", action="store_true", help="one JSON object per cycle")
    parser.add_argument(
        "--granularity", type=size_arg, default=DEFAULT_GRANULARITY, help="bitmap granularity (default 64KiB)"
    )
    parser.add_argument("--runtime-dir", metavar="DIR", help="directory for the NBD socket (0700; default: a temp dir)")


def _print(cycle: int, node: str, result: DirtyRead, as_json: bool) -> None:
    if as_json:
        record = {
            "cycle": cycle,
            "time": round(time.time(), 3),
            "node": node,
            "status": result.status.value,
            "bytes": result.bytes,
            "extents": result.extents.tolist(),
        }
        if result.reason:
            record["reason"] = result.reason
        print(json.dumps(record), flush=True)
        return
    head = f"cycle {cycle}: {result.status.value}, {len(result.extents)} extents, {format_size(result.bytes)}"
    if result.reason:
        head += f" ({result.reason})"
    lines = [head] + [f"  {offset:>16} +{length}" for offset, length in result.extents.tolist()]
    print("\n".join(lines), flush=True)


def run(args: argparse.Namespace) -> int:
    if args.count < 0:
        raise ConfigError("--count", args.count, "must not be negative")
    with SocketMonitor(args.qmp) as monitor:
        file = os.path.realpath(args.file) if args.file else None
        disk = find_disk(discover_disks(monitor), node=args.node, file=file)
        if not disk.eligible:
            print(f"vmcache writes: warning: {disk.filename} is opened with cache.direct=on", file=sys.stderr)
        _log.info(event("writes.disk", node=disk.storage_node, file=disk.filename))
        with DirtyTracker(
            monitor, disk.storage_node, granularity=args.granularity, runtime_dir=args.runtime_dir
        ) as tracker:
            cycle = 0
            while args.count == 0 or cycle < args.count:
                time.sleep(args.interval)
                cycle += 1
                _print(cycle, disk.storage_node, tracker.read(), args.json)
    return 0
