"""Memory and CPU of N agents on one host, idle and busy (paused domains, the real agent).

    .venv/bin/python bench/agents.py [--n 10,30] [--modes idle,busy,reads,reads-inferred] [--window 60] [--interval 10s]
                                     [--disk 1G] [--dir /var/tmp] [--read-rate 10000]

For each N and mode: starts N transient paused TCG domains named
``vmcache-scale-agents-PID-K`` (32 MiB, one sparse writethrough raw disk
of ``--disk`` bytes in ``--dir``, default 1 GiB, budget 64M) with the
vmcache hook installed for the run's own host config (as the live tests
install it: under their hook lock, any vmcache hook that was there put back
after), so every agent is the one the hook starts - exactly one per domain,
whatever hook an earlier ``make install`` left; waits until every agent reports
``running`` and two more intervals, then measures for ``--window`` seconds.
``busy``: every second, each domain gets a 1 MiB guest write (HMP qemu-io
through libvirt) at a random offset of a 128 MiB hot area, and 4 MiB of that
area are read from the image by the host (page-cache residency the agent
takes for guest reads); ``idle``: nothing happens; ``reads``: QEMU reads
``--read-rate`` 4 KiB blocks per second in all (spread over the domains) at
random over each whole disk, asked through an NBD export of the disk's node
(QMP ``nbd-server-start`` + ``block-export-add``) by fio's nbd engine, so
every read is QEMU's preadv of the image, as a guest's would be (the
agents' dirty-bitmap reads are deferred meanwhile: QEMU has one NBD server); ``reads-inferred``: the same
with the agents' CAP_BPF, CAP_PERFMON and CAP_SYS_ADMIN dropped (setpriv),
so they infer reads instead of counting them. Per agent: CPU % over the
window (utime + stime from /proc/PID/stat), and at the end Rss, Pss,
Pss_Anon (smaps_rollup), RssAnon and Threads (status). Prints one table row
per (N, mode): medians over the agents and the maximum. Removes every
domain, agent, disk and directory it made, also on failure.

Disks of 16 TiB and more need ``--dir`` on XFS (ext4 refuses such files):
``apt-get install xfsprogs``, then an XFS file system in a loop file, as
docs/benchmarks.md shows ("A real agent on a 64 TiB thin disk").
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.live.guestlib import guest_write, qmp
from tests.live.hooklib import installed_hook
from tests.live.livelib import (
    MiB,
    cache_metadata,
    connect,
    create_disk,
    destroy_domains,
    domain_xml,
    read_status,
    start_paused,
    wait_for,
)
from vmcache.host.files import file_stem, lock_holder
from vmcache.units import parse_duration, parse_size

import libvirt

libvirt.registerErrorHandler(lambda *_: None, None)  # undefine of a transient domain: expected, not news

PREFIX = f"vmcache-scale-agents-{os.getpid()}-"
HOT = 128 * MiB
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def memory(pid: int) -> dict[str, float]:
    """Rss, Pss, Pss_Anon (smaps_rollup), RssAnon, Threads (status) of ``pid``; sizes in MiB."""
    out: dict[str, float] = {}
    for path, keys in ((f"/proc/{pid}/smaps_rollup", ("Rss", "Pss", "Pss_Anon")),
                       (f"/proc/{pid}/status", ("RssAnon", "Threads"))):
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in keys:
                    number = int(value.split()[0])
                    out[key] = number if key == "Threads" else number / 1024
    return out


def write_config(tmp: Path, interval: str, *, no_bpf: bool = False) -> Path:
    config = tmp / "vmcache.yaml"
    command = (f"agent_command: [{shutil.which('setpriv')}, --bounding-set, '-bpf,-perfmon,-sys_admin', --, {sys.executable}, -m, "
               "vmcache.cli, agent]\n" if no_bpf else "")
    config.write_text(
        f"runtime_dir: {tmp}/run\nlog_dir: {tmp}/log\nhotset_dir: {tmp}/hotsets\ninterval: {interval}\nmin_free: 256M\n"
        "pinned_cap: 4G\nmetrics:\n  ports: 19850-19999\n" + command
    )
    return config


def nbd_readers(doms: list, tmp: Path, disk_size: int, rate: int, seconds: float) -> list[subprocess.Popen]:
    """fio reading each domain's disk through an NBD export of its node: ``rate`` reads/s in all.

    QEMU serves each NBD read with a preadv of the image, as it would a guest's. (A FUSE export cannot
    be mounted from libvirt's QEMU: it runs in a mount namespace whose /dev has no /dev/fuse.) QEMU
    has one NBD server, so the agents' dirty-bitmap reads are deferred while it runs, in every mode.
    """
    procs = []
    for k, dom in enumerate(doms):
        node = next(n["node-name"] for n in qmp(dom, "query-named-block-nodes", {"flat": True})
                    if n["drv"] == "raw")
        sock = tmp / f"nbd-{k}.sock"
        qmp(dom, "nbd-server-start", {"addr": {"type": "unix", "data": {"path": str(sock)}}})
        qmp(dom, "block-export-add", {"type": "nbd", "id": "bench-nbd", "node-name": node, "name": "bench",
                                      "writable": False})
        procs.append(subprocess.Popen(
            ["fio", "--name=reads", "--ioengine=nbd", f"--uri=nbd+unix:///bench?socket={sock}", "--rw=randread",
             "--bs=4k", "--numjobs=4", "--group_reporting", "--thread",
             f"--rate_iops={max(1, rate // len(doms) // 4)}", "--time_based",
             f"--runtime={int(seconds)}", f"--size={disk_size}", "--output-format=json"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
    return procs


def hook_agents(names: list[str], agents_dir: Path) -> list[int]:
    """The pids of the agents the installed hook started for ``names`` (their pidfiles' holders)."""
    return [wait_for(lambda n=name: lock_holder(str(agents_dir / (file_stem(n) + ".pid"))),
                     f"the hook to start {name}'s agent", timeout=120) for name in names]


def wait_gone(pids: list[int]) -> None:
    """Wait until the agents exited (the hook stops them when their domains go)."""
    wait_for(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in pids), "the agents to exit", timeout=60)


def busy_second(doms: list, disks: list[Path], rng: random.Random) -> None:
    """One second of guest activity on every domain: a 1 MiB write and 4 MiB of reads in the hot area."""
    for dom, disk in zip(doms, disks):
        guest_write(dom, rng.randrange(0, HOT, MiB), MiB)
        with open(disk, "rb", buffering=0) as f:
            f.seek(rng.randrange(0, HOT - 4 * MiB, MiB))
            f.read(4 * MiB)


def run(n: int, mode: str, window: float, interval: str, tmp: Path, disk_size: int,
        read_rate: int = 10_000) -> dict[str, float]:
    """One (N, mode) measurement; medians and maxima over the agents."""
    tmp.mkdir()
    config = write_config(tmp, interval, no_bpf=mode == "reads-inferred")
    names = [f"{PREFIX}{n}-{mode}-{k}" for k in range(n)]
    conn = connect()
    pids: list[int] = []
    try:
        with installed_hook(config):
            disks = [create_disk(tmp / f"{name}.raw", disk_size) for name in names]
            doms = [start_paused(conn, domain_xml(name, disk, metadata=cache_metadata("64M")))
                    for name, disk in zip(names, disks)]
            pids = hook_agents(names, tmp / "run" / "agents")
            for name in names:
                wait_for(lambda n=name: (s := read_status(tmp / "run" / "agents", n)) and s.get("state") == "running",
                         f"{name}'s agent to run", timeout=120)
            readers = (nbd_readers(doms, tmp, disk_size, read_rate, window + 3 * parse_duration(interval, key="--interval"))
                       if mode.startswith("reads") else [])
            time.sleep(2 * parse_duration(interval, key="--interval"))
            rng = random.Random(n)
            before = [cpu_seconds(pid) for pid in pids]
            started = time.monotonic()
            while (left := window - (time.monotonic() - started)) > 0:
                tick = time.monotonic()
                if mode == "busy":
                    busy_second(doms, disks, rng)
                time.sleep(max(0.0, min(left, 1.0 - (time.monotonic() - tick))))
            elapsed = time.monotonic() - started
            dead = [pid for pid in pids if not os.path.exists(f"/proc/{pid}")]
            if dead:
                raise RuntimeError(f"agents exited during the run: {dead}")
            cpu = [100 * (cpu_seconds(pid) - b) / elapsed for pid, b in zip(pids, before)]
            mem = [memory(pid) for pid in pids]
            signals = {read_status(tmp / "run" / "agents", name).get("read_signal") for name in names}
            for proc in readers:
                proc.terminate()
                out, _ = proc.communicate()
                if "{" in out:  # a terminated fio says so on stdout before its JSON
                    report = json.loads(out[out.index("{"):])
                    print(f"  fio: {float(report['jobs'][0]['read']['iops']):.0f} reads/s", flush=True)
            if readers:
                print(f"  read signal: {sorted(s or '?' for s in signals)}", flush=True)
            destroy_domains(PREFIX)
            wait_gone(pids)  # stopped by the hook, while it is still installed
    finally:
        destroy_domains(PREFIX)
        conn.close()
    row = {"cpu_pct": statistics.median(cpu), "cpu_pct_max": max(cpu), "cpu_pct_sum": sum(cpu)}
    for key in ("Rss", "Pss", "Pss_Anon", "RssAnon", "Threads"):
        values = [m[key] for m in mem]
        row[key] = statistics.median(values)
        row[key + "_max"] = max(values)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", default="10,30")
    ap.add_argument("--modes", default="idle,busy")
    ap.add_argument("--window", type=float, default=60.0)
    ap.add_argument("--interval", default="10s")
    ap.add_argument("--read-rate", type=int, default=10_000, help="reads mode: QEMU's 4 KiB reads per second in all")
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--disk", default="1G", help="size of each domain's sparse disk (16T and more: --dir on XFS, needs xfsprogs)")
    args = ap.parse_args()
    disk_size = parse_size(args.disk, key="--disk")
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, load {os.getloadavg()[0]:.2f}, "
          f"interval {args.interval}, window {args.window:g} s, disks of {args.disk} in {args.dir}")
    print("| N | mode | CPU % per agent, median (max) | CPU % all agents | RssAnon MiB | Rss MiB | Pss MiB | "
          "Pss_Anon MiB | threads |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    with ExitStack() as stack:
        tmp = Path(tempfile.mkdtemp(prefix="vmcache-scale-agents-", dir=args.dir))
        stack.callback(shutil.rmtree, tmp, ignore_errors=True)
        stack.callback(destroy_domains, PREFIX)
        for n in (int(x) for x in args.n.split(",")):
            for i, mode in enumerate(args.modes.split(",")):  # a mode may come again: arms interleaved
                r = run(n, mode, args.window, args.interval, tmp / f"{n}-{mode}-{i}", disk_size, args.read_rate)
                print(f"| {n} | {mode} | {r['cpu_pct']:.2f} ({r['cpu_pct_max']:.2f}) | {r['cpu_pct_sum']:.1f} | "
                      f"{r['RssAnon']:.1f} ({r['RssAnon_max']:.1f}) | {r['Rss']:.1f} | {r['Pss']:.1f} | "
                      f"{r['Pss_Anon']:.1f} | {r['Threads']:.0f} ({r['Threads_max']:.0f}) |", flush=True)
    print(f"load after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
