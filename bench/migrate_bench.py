"""Live migration to a cold host (issue 41 item 5): does a VM's hot set survive a move to a host with its own cache?

Runs on this machine with the two hosts of tests/host/migrate.sh up, the
hosts' vmcache at the product's defaults and their delay devices logging
reads, one boot per device class (VMCACHE_MIGRATE_READ_MS: 4.8 hdd, 0.3
ssd)::

    VMCACHE_MIGRATE_CONFIG=default VMCACHE_MIGRATE_LOG_READS=1 VMCACHE_MIGRATE_READ_MS=4.8 \\
        tests/host/migrate.sh exec .venv/bin/python bench/migrate_bench.py --workload zoned

Arms are ``workload-device-mode``: the workload (``zoned``: fio 4k randrw
80/20 QD1 sync, 90% of it on the first 10% of a 2 GiB image; ``web``: the
web server trace, bench/e2e_trace.py's window), the device class, and who
manages the cache (``kernel``: no vmcache on either host acts; ``vmcache``:
the guest opted in on A, budget 256M; ``inferred``, on request: the same
with ``read_model: inferred`` on both hosts, the counter still running).
Every arm runs once per round, in an order rotated from round to round
(bench/order.py). One run
(bench/migrate_run.py): the guest warm on A, migrated live to B, measured
120 s after the switch from this machine: the guest's requests from
libvirt's block stats, the device reads from both delay devices, the set's
residency on B through B's own mount. Raw results (JSON per run, the
agents' journals, consoles) go to .bench/migrate-<time>/; the summary
(Markdown, for docs/benchmarks.md "Live migration to a cold host") to
stdout and table.md there.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import e2e_trace
from bench.e2e_host import MIB, initrd_with, log, run as run_cmd
from bench.migrate_report import cpu_table, goal_table, iops_table, partial_note, reads_table, set_table
from bench.migrate_run import CONFFILE, PREFIX, SHIPPED, Setup, Trace, run
from bench.order import round_order
from tests.host.migration import close_sides, open_sides
from tests.host.twohosts import Host, delay_stats_from_env, hosts_from_env, plain_from_env, read_logs_from_env, shared_from_env

REPO = Path(__file__).resolve().parent.parent
DEVICES = {"4.8": "hdd", "0.3": "ssd"}   # VMCACHE_MIGRATE_READ_MS -> the device class bench/e2e_host.py names
WORKLOADS = ("zoned", "web")
MODES = ("kernel", "vmcache")
EXTRA_MODES = ("inferred",)   # vmcache with read_model: inferred (the counter runs; the model infers)
IMAGE = f"{PREFIX}disk.raw"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="zoned", help="zoned, web or both (comma-separated; default zoned)")
    p.add_argument("--modes", default=",".join(MODES),
                   help="arms' modes (default kernel,vmcache; also inferred: vmcache deciding on inferred reads)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--measure", type=float, default=120.0, help="seconds measured after the switch (default 120)")
    p.add_argument("--on-a", type=float, default=60.0,
                   help="zoned: least seconds of fio on A before the migration (default 60; the warm reference is "
                        "the 30 s before it)")
    p.add_argument("--on-a-cap", type=float, default=300.0,
                   help="zoned, vmcache arm: most seconds on A waiting for A's agent to pin --pin-share of the zone "
                        "(default 300)")
    p.add_argument("--pin-share", type=float, default=0.9,
                   help="zoned, vmcache arm: share of the zone A's agent pins before the migration (default 0.9)")
    p.add_argument("--settle", type=float, default=0.0,
                   help="zoned, vmcache arm: or once A's agent's pins stay the same this many seconds (default 0: "
                        "off; pins that pause for three cycles may still grow)")
    p.add_argument("--budget-mib", type=int, default=256, help="the vmcache arm's budget (default 256)")
    p.add_argument("--disk-gib", type=int, default=2, help="image size (default 2 GiB, fully allocated)")
    p.add_argument("--memory-mib", type=int, default=384, help="guest RAM (default 384)")
    p.add_argument("--trace-requests", type=int, default=0,
                   help="web: replay this many requests from the trace's start (default 0: all that fit the disk, "
                        "so that the measured part lasts as long as it can)")
    p.add_argument("--out", default=".bench", help="raw results go to OUT/migrate-<time>/")
    args = p.parse_args()
    args.workloads = args.workload.split(",")
    args.mode_list = args.modes.split(",")
    if set(args.workloads) - set(WORKLOADS) or set(args.mode_list) - set(MODES + EXTRA_MODES):
        p.error(f"workloads: {', '.join(WORKLOADS)}; modes: {', '.join(MODES + EXTRA_MODES)}")
    return args


def check_hosts(hosts: tuple[Host, Host]) -> list[str]:
    """Why the hosts are not what the bench measures (empty: they are): the product's default config on both,
    B's read log."""
    problems = []
    if os.environ.get("VMCACHE_MIGRATE_CONFIG") != "default":
        problems.append("migrate.sh edited the hosts' conffile for its checks: run it with VMCACHE_MIGRATE_CONFIG=default")
    shipped = SHIPPED.read_text()
    for host in hosts:
        if host.path(CONFFILE).read_text() != shipped:
            problems.append(f"{host.name}'s {CONFFILE} is not the one hooks/vmcache.yaml ships")
    if read_logs_from_env() is None:
        problems.append("the delay devices log no reads (B's agent's loads): run migrate.sh with VMCACHE_MIGRATE_LOG_READS=1")
    return problems


def make_image(path: Path, size: int) -> None:
    """A fully allocated raw image (written before any host looks it up: the delay device freezes its size)."""
    log(f"writing a fully allocated {size >> 30} GiB raw image {path}")
    run_cmd(["dd", "if=/dev/zero", f"of={path}", "bs=4M", f"count={size // (4 * MIB)}", "oflag=direct", "status=none"])


def prepare_trace(disk_bytes: int, budget: int, limit: int, out: Path) -> Trace:
    """The web trace's iologs in an initramfs in the plain directory (both hosts see it), the set to watch."""
    r = e2e_trace.replay(e2e_trace.load(e2e_trace.TRACES["webserver"]), disk_bytes, e2e_trace.WARMUP_SHARE,
                         budget, limit)
    plain, there = plain_from_env()
    initrd_with(plain / "guest" / "initramfs.cpio", {"trace/1.iolog": r.warmup, "trace/2.iolog": r.measured},
                plain / f"{PREFIX}trace.cpio")
    (out / "trace-oracle.txt").write_text("".join(f"{s} {n}\n" for s, n in r.oracle))
    log(f"web trace: {r.requests[0]} + {r.requests[1]} requests (trace time {r.trace_seconds[0]:.0f} + "
        f"{r.trace_seconds[1]:.0f} s) on {r.disk_used / MIB:.0f} MiB; the set watched on B: the measured part's "
        f"{len(r.oracle)} most-read runs, {sum(n for _, n in r.oracle) / MIB:.0f} MiB")
    return Trace(f"{there}/{PREFIX}trace.cpio", tuple(r.oracle), r.requests)


def machine(hosts: tuple[Host, Host]) -> dict:
    def out(argv: list[str]) -> str:
        return subprocess.run(argv, capture_output=True, text=True, check=False).stdout.strip()
    return {"kernel": os.uname().release, "cpus": os.cpu_count(),
            "commit": out(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"]),
            "hosts": {h.name: {"vmcache": h.run("dpkg-query", "-W", "-f", "${Version}", "vmcache"),
                               "libvirt": h.run("virsh", "-q", "version", "--daemon").split()[-1]} for h in hosts}}


def estimate(args: argparse.Namespace, arms: list[tuple[str, str]], trace: Trace | None) -> int:
    """Minutes the rounds take, about: per run ~75 s of caches, boot, migration and clean-up, the time on A (the
    vmcache arm's wait for its pins ~30 s more; the trace's warm-up part at ~300 requests a second), the
    measurement."""
    on_a = {"kernel": args.on_a, "vmcache": args.on_a + 30}
    warmup = trace.requests[0] / 300 if trace else 0
    seconds = sum(75 + (warmup if w == "web" else on_a[m]) + args.measure for w, m in arms)
    return round(args.rounds * seconds / 60)


def report(runs: list[dict], meta: dict, out: Path) -> str:
    head = (f"`{meta['command']}`, {meta['started']} - {meta['finished']} UTC, commit {meta['machine']['commit']}, "
            f"device {meta['device']} ({meta['read_ms']} ms a miss in the delay device, a flush "
            f"{meta.get('fsync_ms')} ms), rounds: {meta['rounds']}, product defaults on both hosts")
    parts = [head, goal_table(runs), iops_table(runs), reads_table(runs), set_table(runs), cpu_table(runs),
             partial_note(runs)]
    text = "\n\n".join(p for p in parts if p)
    (out / "summary.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    (out / "table.md").write_text(text + "\n")
    return text


def main() -> int:
    args = parse_args()
    hosts = hosts_from_env()
    if hosts is None:
        print("migrate_bench: run it through tests/host/migrate.sh exec (module docstring)", file=sys.stderr)
        return 2
    problems = check_hosts(hosts)
    if problems:
        print("migrate_bench: " + "\n".join(problems), file=sys.stderr)
        return 2
    read_ms = os.environ.get("VMCACHE_MIGRATE_READ_MS", "0.3")
    device = DEVICES.get(read_ms, f"{read_ms}ms")
    out = Path(args.out).resolve() / time.strftime("migrate-%Y%m%d-%H%M%S")
    out.mkdir(parents=True)

    def on_signal(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_signal)

    here, _ = shared_from_env()
    disk_bytes = args.disk_gib << 30
    read_logs = read_logs_from_env()
    assert read_logs is not None
    arms = [(w, m) for w in args.workloads for m in args.mode_list]
    meta = {"command": " ".join(sys.argv), "device": device, "read_ms": read_ms, "rounds": args.rounds,
            "fsync_ms": os.environ.get("VMCACHE_MIGRATE_FSYNC_MS", "a real fdatasync"),
            "settings": {k: v for k, v in vars(args).items()}, "machine": machine(hosts),
            "started": time.strftime("%Y-%m-%d %H:%M")}
    runs: list[dict] = []
    sides = open_sides(hosts)
    try:
        make_image(here / IMAGE, disk_bytes)
        trace = (prepare_trace(disk_bytes, args.budget_mib * MIB, args.trace_requests, out)
                 if "web" in args.workloads else None)
        st = Setup(sides, IMAGE, disk_bytes, device, out, delay_stats_from_env(), read_logs[1],
                   budget_mib=args.budget_mib, memory_mib=args.memory_mib, measure=args.measure, on_a=args.on_a,
                   on_a_cap=args.on_a_cap, pin_share=args.pin_share, settle=args.settle, trace=trace)
        log(f"{len(arms)} arms x {args.rounds} rounds on {device}, about {estimate(args, arms, trace)} min; "
            f"raw results in {out}")
        for round_ in range(1, args.rounds + 1):
            order = round_order(arms, round_)
            log(f"round {round_}/{args.rounds}, in this order: {', '.join(f'{w}-{device}-{m}' for w, m in order)}")
            for slot, (workload, mode) in enumerate(order, 1):
                runs.append(run(st, workload, mode, round_, slot))
    except KeyboardInterrupt:
        log("interrupted: cleaning up")
    finally:
        close_sides(sides, PREFIX)
        (here / IMAGE).unlink(missing_ok=True)
        meta["finished"] = time.strftime("%H:%M")
        print("\n" + report(runs, meta, out) + f"\n\nraw results: {out}")
    return 0 if runs and all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
