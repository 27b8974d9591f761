"""Residency scan: vmcache (cachestat + mincore) against vmtouch (mincore of every page).

Run: ``.venv/bin/python bench/bench_scan.py [--dir /tmp] [--skip-full]``

Two images, made here and deleted afterwards:

1. a 1 TiB sparse image with 512 MiB resident (8 ranges of 64 MiB, some
   not aligned to 4 MiB);
2. a fully resident 4 GiB image;
3. a 4 GiB image with 10% of its 64 KiB pieces resident, scattered at
   random (the worst case for cachestat narrowing).

Each is scanned by ``vmtouch IMAGE``; by the command ``vmcache scan IMAGE``
(whole-file cachestat, no numpy) and ``vmcache scan IMAGE --blocks``
(per-block cachestat + mincore scan) as subprocesses, the way an operator
runs them; and in process by ``file_cachestat`` and ``scan_residency``.
Two start-up rows give the floor: ``python -c pass`` and importing the CLI
plus building the ``scan`` parser without scanning.

The resident ranges are held with vmcache's Pinner (mmap + mlock) while
measuring: this host's kernel reclaims clean page cache proactively, and
the two tools must see the same pages. Every tool's resident page count is
printed next to its time, so a wrong answer cannot hide behind a fast one.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vmcache.host.cachestat import file_cachestat  # noqa: E402
from vmcache.host.pagecache import scan_residency  # noqa: E402
from vmcache.host.pinner import Pinner  # noqa: E402
from vmcache.model.region import Region  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40
VMCACHE = [str(ROOT / ".venv" / "bin" / "vmcache")]


def timed(fn: Callable[[], int], runs: int) -> tuple[list[float], int]:
    """Wall-clock seconds of ``runs`` calls, and what the last call returned (resident pages)."""
    times, pages = [], 0
    for _ in range(runs):
        t0 = time.perf_counter()
        pages = fn()
        times.append(time.perf_counter() - t0)
    return times, pages


def vmtouch(path: Path) -> int:
    out = subprocess.run(["vmtouch", str(path)], check=True, capture_output=True, text=True).stdout
    match = re.search(r"Resident Pages:\s*(\d+)/", out)
    assert match, out
    return int(match.group(1))


CLI_INNER: list[float] = []  # the scan time the CLI reports about itself (no interpreter start-up)


def cli_scan(path: Path, *extra: str) -> int:
    """``vmcache scan IMAGE [extra]`` as a subprocess, human output as an operator reads it; its resident pages."""
    out = subprocess.run([*VMCACHE, "scan", str(path), *extra], check=True, capture_output=True, text=True).stdout
    pages = re.search(r"Resident Pages:\s*(\d+)/", out)
    elapsed = re.search(r"Elapsed:\s*([0-9.]+) seconds", out)
    assert pages and elapsed, out
    CLI_INNER.append(float(elapsed.group(1)))
    return int(pages.group(1))


def python_floor() -> int:
    """The interpreter alone (this venv, site included)."""
    subprocess.run([sys.executable, "-c", "pass"], check=True, cwd=ROOT)
    return 0


def startup() -> int:
    """Interpreter start plus importing the CLI and building the ``scan`` parser, without scanning."""
    code = "import vmcache.cli as c; c.build_parser('scan')"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    return 0


def whole_file(path: Path) -> int:
    return file_cachestat(path)[1].nr_cache


def in_process(path: Path) -> int:
    return scan_residency(path, 1 * MiB).resident_pages


def make_image(path: Path, size: int, ranges: list[tuple[int, int]]) -> None:
    """Sparse image of ``size`` with data written (and synced) in ``ranges``."""
    chunk = os.urandom(8 * MiB)
    with open(path, "wb") as f:
        f.truncate(size)
        for off, length in ranges:
            f.seek(off)
            for pos in range(0, length, len(chunk)):
                f.write(chunk[: min(len(chunk), length - pos)])
        f.flush()
        os.fsync(f.fileno())


def fmt(times: list[float]) -> str:
    return f"best {min(times) * 1000:9.2f} ms  median {statistics.median(times) * 1000:9.2f} ms  (n={len(times)})"


def case(name: str, path: Path, ranges: list[tuple[int, int]], runs_vmtouch: int, runs_fast: int) -> dict[str, object]:
    with Pinner(path, floor_bytes=0) as pinner:
        pinner.apply([Region(off, length, 1.0) for off, length in ranges], budget=sum(n for _, n in ranges))
        held = pinner.pinned_bytes
        print(f"\n== {name}: {path.stat().st_size / GiB:g} GiB image, {held / MiB:g} MiB resident (mlocked)")
        results = {}
        for label, fn, runs in (
            ("vmtouch IMAGE", lambda: vmtouch(path), runs_vmtouch),
            ("vmcache scan IMAGE (subprocess)", lambda: cli_scan(path), runs_fast),
            ("vmcache scan IMAGE --blocks (subprocess)", lambda: cli_scan(path, "--blocks"), runs_fast),
            ("file_cachestat() in process", lambda: whole_file(path), runs_fast),
            ("scan_residency() in process", lambda: in_process(path), runs_fast),
        ):
            times, pages = timed(fn, runs)
            results[label] = (times, pages)
            print(f"  {label:44s} {fmt(times)}  resident_pages={pages}")
            if label.startswith("vmcache scan"):
                print(f"    (scan time the CLI reports itself, 0.1 ms resolution: median "
                      f"{statistics.median(CLI_INNER) * 1000:.1f} ms)")
                CLI_INNER.clear()
        for label, fn in (("python -c pass", python_floor), ("python + vmcache.cli scan parser, no scan", startup)):
            times, _ = timed(fn, runs_fast)
            print(f"  {label:44s} {fmt(times)}")
    vt = statistics.median(results["vmtouch IMAGE"][0])
    for label in results:
        if label != "vmtouch IMAGE":
            print(f"  vmtouch / {label:44s} = {vt / statistics.median(results[label][0]):9.1f}x (medians)")
    counts = {pages for _, pages in results.values()}
    print(f"  resident pages agree: {len(counts) == 1} {sorted(counts)}")
    return results


def describe() -> str:
    load = Path("/proc/loadavg").read_text().split()[:3]
    mem = next(line for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal")).split()[1]
    query = ["dpkg-query", "-W", "-f=vmtouch ${Version}", "vmtouch"]
    vmtouch_version = subprocess.run(query, capture_output=True, text=True).stdout.splitlines()[0:1]
    fs = subprocess.run(["df", "-T", "/tmp"], capture_output=True, text=True).stdout.splitlines()[-1].split()[1]
    return (
        f"kernel {platform.release()}, {os.cpu_count()} cpus, {int(mem) // 1024 // 1024} GiB RAM, "
        f"python {platform.python_version()}, {vmtouch_version[0] if vmtouch_version else 'vmtouch'}, /tmp on {fs}, "
        f"load average {' '.join(load)}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp", help="where to create the images (default /tmp)")
    parser.add_argument("--skip-full", action="store_true", help="only the 1 TiB sparse case")
    parser.add_argument("--runs", type=int, default=11, help="runs of the fast scanners (vmtouch on 1 TiB: 2)")
    args = parser.parse_args()
    if not shutil.which("vmtouch"):
        print("vmtouch is not installed", file=sys.stderr)
        return 1
    print(describe())
    work = Path(args.dir) / f"vmcache-bench-{os.getpid()}"
    work.mkdir()
    try:
        sparse = work / "sparse-1T.img"
        # 8 x 64 MiB; every other one starts 1 MiB off a 4 MiB boundary.
        ranges = [(i * 128 * GiB + (i % 2) * MiB, 64 * MiB) for i in range(8)]
        make_image(sparse, TiB, ranges)
        case("sparse 1 TiB, 512 MiB resident", sparse, ranges, runs_vmtouch=2, runs_fast=args.runs)
        sparse.unlink()
        if not args.skip_full:
            full = work / "full-4G.img"
            make_image(full, 4 * GiB, [(0, 4 * GiB)])
            case("4 GiB fully resident", full, [(0, 4 * GiB)], runs_vmtouch=args.runs, runs_fast=args.runs)
            full.unlink()
            scattered = work / "scattered-4G.img"
            piece = 64 << 10
            rng = random.Random(1)
            pieces = [(i * piece, piece) for i in sorted(rng.sample(range(4 * GiB // piece), 4 * GiB // piece // 10))]
            make_image(scattered, 4 * GiB, pieces)
            case("4 GiB, 10% scattered in 64 KiB pieces", scattered, pieces,
                 runs_vmtouch=args.runs, runs_fast=args.runs)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
