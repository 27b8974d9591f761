"""One dirty-bitmap tracker cycle on a 1 TiB disk with 10,000 scattered dirty extents.

Run: ``.venv/bin/python bench/bench_tracker.py [--extents 10000] [--rounds 20] [--dir /tmp]``

A paused qemu-system-x86_64 (TCG) with a 1 TiB sparse raw image as a
writethrough virtio-blk disk. ``--extents`` 4 KiB pieces are written at
random 64 KiB blocks spread over the whole disk (no two in the same or
neighbouring blocks) through HMP ``qemu-io`` (about a minute), then each
round times one ``DirtyTracker.read()``: rotate (transaction), NBD server
start, node query, export, libnbd block_status over 1 TiB, export delete,
server stop, bitmap remove. Round 1 reads the qemu-io writes; later rounds
first merge a bitmap that recorded the same writes into the tracker's
active one (QMP ``block-dirty-bitmap-merge``, not timed). The extents read
are checked against those written every round, so a wrong answer cannot
hide behind a fast one. The NBD read alone is timed too.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.qemu_helpers import STORAGE_NODE, QemuVM, image  # noqa: E402
from vmcache.host.nbdreader import read_dirty_extents  # noqa: E402
from vmcache.host.qmp import SocketMonitor  # noqa: E402
from vmcache.host.tracker import DirtyTracker  # noqa: E402

TiB = 1 << 40
TEMPLATE = "bench-template"
G = 64 * 1024


def machine() -> str:
    cpu = "unknown cpu"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    cores = len([ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("processor")])
    version = subprocess.run(
        ["qemu-system-x86_64", "--version"], capture_output=True, text=True, check=False
    ).stdout.splitlines()[0]
    return f"{cpu}, {cores} cores, kernel {platform.release()}, {version}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--extents", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()

    nblocks = TiB // G
    rng = random.Random(42)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="vmcache-bench-tracker-") as tmp:
        work = Path(tmp)
        img = image(work / "big.raw", "raw", "1T")
        with QemuVM(work, img, "raw") as vm, SocketMonitor(str(vm.tool_socket), timeout=30) as monitor:
            nbd_times: list[float] = []

            def timed_reader(*a, **kw):
                t0 = time.perf_counter()
                try:
                    return read_dirty_extents(*a, **kw)
                finally:
                    nbd_times.append(time.perf_counter() - t0)

            cycle_times = []
            with DirtyTracker(monitor, STORAGE_NODE, runtime_dir=str(work / "run"), reader=timed_reader) as t:
                # Every third block at most: written blocks never touch.
                picks = sorted(rng.sample(range(nblocks // 3), args.extents))
                offsets = [p * 3 * G for p in picks]
                expected = [[o, G] for o in offsets]
                # A bitmap of the bench's own records the same writes, so
                # later rounds can re-dirty the tracker's bitmap by merging
                # it in (milliseconds instead of a minute of qemu-io).
                vm.driver("block-dirty-bitmap-add", node=STORAGE_NODE, name=TEMPLATE, granularity=G)
                t0 = time.perf_counter()
                for off in offsets:
                    vm.hmp_write(off, 4096)
                write_s = time.perf_counter() - t0
                vm.driver("block-dirty-bitmap-disable", node=STORAGE_NODE, name=TEMPLATE)
                print(f"wrote {len(offsets)} extents of 4 KiB through HMP qemu-io in {write_s:.1f}s")
                for rnd in range(args.rounds):
                    if rnd:
                        vm.driver("block-dirty-bitmap-merge", node=STORAGE_NODE, target=t.active, bitmaps=[TEMPLATE])
                    t0 = time.perf_counter()
                    got = t.read()
                    cycle = time.perf_counter() - t0
                    cycle_times.append(cycle)
                    ok = got.extents.tolist() == expected
                    print(
                        f"round {rnd + 1} ({'qemu-io writes' if rnd == 0 else 'merged'}): "
                        f"cycle {cycle * 1000:.1f} ms (NBD read {nbd_times[-1] * 1000:.1f} ms), "
                        f"{len(got.extents)} extents read, exact={ok}"
                    )
                    if not ok:
                        print("MISMATCH between written and read extents", file=sys.stderr)
                        return 1
                vm.driver("block-dirty-bitmap-remove", node=STORAGE_NODE, name=TEMPLATE)
        summary(args.extents, cycle_times, nbd_times)
    return 0


def summary(extents: int, cycle_times: list[float], nbd_times: list[float]) -> None:
    print(f"machine: {machine()}")
    print(
        f"one cycle, 1 TiB raw, {extents} dirty extents: median {statistics.median(cycle_times) * 1000:.1f} ms, "
        f"p90 {sorted(cycle_times)[int(0.9 * (len(cycle_times) - 1))] * 1000:.1f} ms, "
        f"min {min(cycle_times) * 1000:.1f} ms, max {max(cycle_times) * 1000:.1f} ms over {len(cycle_times)} rounds; "
        f"NBD read median {statistics.median(nbd_times) * 1000:.1f} ms"
    )


if __name__ == "__main__":
    sys.exit(main())
