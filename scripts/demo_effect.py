"""make demo's measurement: what vmcache does for the demo guest when it starts on an empty page cache.

    .venv/bin/python scripts/demo_effect.py DOMAIN IMAGE CONSOLE [--seconds 20] [--learn 45]

The domain runs the demo guest (fio 4k random 80/20 read/write, sync, 80%
of the I/O on the first 10% of its disk) and is opted in. A host reboot,
a restart after an eviction or a live migration starts a VM on a page
cache that holds nothing of its disk: that is where vmcache pays. So:

1. the guest runs ``--learn`` seconds while its agent counts what it reads,
   then is powered off: the agent saves its hot set as it stops;
2. restarted on an evicted image with vmcache switched off (``vmcache
   disable --config``): the kernel alone, measured ``--seconds`` from the
   moment fio begins;
3. restarted on an evicted image with vmcache on again: its agent restores
   the saved set while the guest boots; measured the same way. The domain
   keeps running.

The guest's I/O requests come from libvirt's block statistics, the host
disk's reads from /proc/diskstats. Prints one line per window and the
ratio. Exits 1 when the agent saves no hot set (its log says why).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import libvirt

MIB = 1 << 20


def disk_sectors_read() -> int:
    """Sectors read from the host's whole disks (not partitions) so far."""
    total = 0
    with open("/proc/diskstats") as f:
        for line in f:
            fields = line.split()
            name = fields[2]
            if os.path.exists(f"/sys/block/{name}") and not name.startswith(("loop", "ram", "nbd")):
                total += int(fields[5])
    return total


def window(dom: libvirt.virDomain, seconds: float) -> tuple[float, float]:
    """(the guest's I/O requests per second, MiB read from the host's disks) over ``seconds``."""
    before, sectors, t0 = dom.blockStats("vda"), disk_sectors_read(), time.monotonic()
    time.sleep(seconds)
    after, t1 = dom.blockStats("vda"), time.monotonic()
    ops = (after[0] - before[0]) + (after[2] - before[2])
    return ops / (t1 - t0), (disk_sectors_read() - sectors) * 512 / MIB


def vmcache(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["vmcache", *args], capture_output=True, text=True)


def agent_running(name: str) -> bool:
    done = vmcache("status", name, "--json")
    try:
        found = json.loads(done.stdout) if done.returncode == 0 else []
    except ValueError:
        return False
    return bool(found and found[0].get("running"))


def saved_bytes(name: str) -> int:
    """Bytes of the hot set the domain's next start restores (the newest of its XML's and the host's copy)."""
    done = vmcache("hotset", name, "--json")
    try:
        saved: dict[str, Any] | None = json.loads(done.stdout) if done.returncode == 0 else None
    except ValueError:
        return 0
    return sum(d.get("bytes", 0) for d in (saved or {}).get("disks", []))


def wait(what: str, ready: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return True
        time.sleep(0.5)
    print(f"demo: gave up waiting {timeout:.0f} s for {what}", file=sys.stderr)
    return False


def fio_began(console: Path) -> bool:
    return console.exists() and b"VMCACHE-FIO-BEGIN" in console.read_bytes()


def power_off(dom: libvirt.virDomain, name: str) -> None:
    if dom.isActive():
        dom.destroy()
    wait("the agent to stop", lambda: not agent_running(name), 30)


def cold_start(dom: libvirt.virDomain, image: Path, console: Path) -> float | None:
    """Evict the image (as a reboot leaves it), start the domain, wait until the guest's fio begins; the MiB
    read from the host's disks meanwhile (the guest's boot, and a warm start's restore), None: fio never began."""
    subprocess.run(["vmtouch", "-q", "-e", str(image)], check=True)
    sectors = disk_sectors_read()
    dom.create()
    if not wait("the guest's fio to begin", lambda: fio_began(console), 120):
        return None
    return (disk_sectors_read() - sectors) * 512 / MIB


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("domain")
    p.add_argument("image", type=Path)
    p.add_argument("console", type=Path)
    p.add_argument("--seconds", type=float, default=20.0, help="each measured window (default 20)")
    p.add_argument("--learn", type=float, default=45.0, help="the first run, while the agent learns (default 45)")
    args = p.parse_args()
    name = args.domain
    dom = libvirt.open("qemu:///system").lookupByName(name)
    if not wait("the guest's fio to begin", lambda: fio_began(args.console), 120):
        return 1
    print(f"demo: the guest runs {args.learn:g} s while vmcache counts what it reads")
    time.sleep(args.learn)
    subprocess.run(["vmcache", "status", name])
    power_off(dom, name)
    saved = saved_bytes(name)
    if not saved:
        print(f"demo: the agent saved no hot set: see /var/log/vmcache/agent-{name}.log", file=sys.stderr)
        return 1
    print(f"demo: {name} powered off; its agent saved a hot set of {saved / MIB:.0f} MiB as it stopped")

    vmcache("disable", name, "--config")
    print(f"\ndemo: restart 1 on an evicted image, vmcache switched off (the kernel alone); "
          f"measuring {args.seconds:g} s")
    booting = [cold_start(dom, args.image, args.console)]
    if booting[0] is None:
        return 1
    cold = window(dom, args.seconds)
    power_off(dom, name)
    vmcache("enable", name, "--config")
    print(f"demo: restart 2 on an evicted image, vmcache on: its agent restores the saved set while the guest "
          f"boots; measuring {args.seconds:g} s")
    booting.append(cold_start(dom, args.image, args.console))
    if booting[1] is None:
        return 1
    warm = window(dom, args.seconds)
    print(f"\ndemo: the guest's I/O (fio 4k random 80/20 read/write, sync) in its first {args.seconds:g} s after a "
          "restart on an empty page cache:")
    rows = (("kernel alone:      ", cold, booting[0]), ("vmcache warm start:", warm, booting[1]))
    for what, (iops, read), boot in rows:
        print(f"  {what} {iops:7.0f} IOPS, {read:6.1f} MiB read from the host's disk ({boot:.0f} MiB while it booted)")
    print(f"  vmcache / kernel alone: {warm[0] / cold[0]:.2f}x. vmcache read its saved set in large reads while the "
          "guest booted;\n  a miss costs what this host's disk takes for a 4 KiB read, and on slow or network "
          "storage the gap\n  is wider (docs/benchmarks.md).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
