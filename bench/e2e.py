"""End-to-end benchmark (`make bench`): a real libvirt guest running fio, arms interleaved over rounds.

Every run boots the tiny test guest (scripts/build-guest.sh) as a transient
libvirt domain (``type='qemu'``, TCG) on one fully allocated raw image with
``cache='writethrough'`` and reads fio's JSON from its serial console.
Arms are ``scenario-device-mode`` (bench/e2e_arms.py): the scenario is what
the guest and its neighbours do, the device how much a miss costs (a FUSE
delay device under the page cache, bench/delaydev.py), the mode who manages
the cache (evicted, kernel, vmcache, oracle). How one run is set up (memory
cgroup, limit, delay device) is in bench/e2e_run.py; docs/benchmarks.md
says why.

Rounds: every selected arm runs once per round, for ``--rounds`` rounds,
in an order rotated from round to round (bench/order.py: round r starts at
arm (r-1) mod n of the selection, so no arm always runs first and, over n
rounds, every arm takes every place once), so the host's noise and the
order's own effects hit every arm alike. Each run's row records its
``slot`` (its place in its round) and the log prints every round's order.
A set that warm-starts learns its hot set once, before the first round.
The report gives per arm the median and min-max over rounds, and ratios
taken within each round.

Run as root with the repository's venv, after scripts/bench.sh set things
up::

    .venv/bin/python bench/e2e.py [--set default|long] [--arms a,b] [--rounds 3]

Raw results (fio JSON, console logs, samples) go to .bench/e2e-<time>/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import libvirt
import yaml

from bench import e2e_trace
from bench.e2e_arms import AGENT_MODES, GOALS, MODE_HOST_SETTINGS, SCENARIOS, SETS, Arm, every_arm
from bench.e2e_host import DEVICES, MIB, Cgroup, evict, initrd_with, log, mount_delay, run, unmount_delay, warm
from bench.e2e_plan import Settings, TraceFiles, guest_seconds
from bench.e2e_report import (arm_table, boot_table, device_check_line, figures, goal_table, miss_figures,
                              time_to_steady)
from bench.e2e_run import HOST_CONFIG, destroy_ours, ensure_hook, host_config, hook_lock, learn_hotset, run_arm
from bench.order import round_order


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="scenarios: " + "; ".join(f"{s.name}: {s.help}" for s in SCENARIOS.values()))
    p.add_argument("--set", choices=sorted(SETS), default="default",
                   help="arms to run: default (the goals, ~50 min at the default runtimes), long, warm or peers "
                        "(vmcache against a static partition, the alternating pair, the web server trace)")
    p.add_argument("--arms", default="", help="comma-separated arm names instead of --set, e.g. reuse-ssd-kernel")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--runtime", type=int, default=20, help="seconds of each measured fio run (default 20)")
    p.add_argument("--warmup", type=int, default=60,
                   help="seconds of the warm-up fio run before the measured one (default 60: at the product's defaults an "
                        "agent needs ~40-50 s from the domain's start to learn and load a 205 MiB hot set at "
                        "prefetch_rate 8 MiB/s; evicted arms have none)")
    p.add_argument("--slow-warmup", type=int, default=60,
                   help="warm-up on the HDD-class device, where learning and loading the hot set take longer "
                        "(default 60)")
    p.add_argument("--gap", type=int, default=60, help="periodic scenario: seconds between hot phases (default 60)")
    p.add_argument("--cache-mib", type=int, default=512,
                   help="page cache every run may use: cgroup limit = QEMU anon + this (default 512)")
    p.add_argument("--budget-mib", type=int, default=256, help="vmcache budget in the domain metadata (default 256)")
    p.add_argument("--model", default="",
                   help="model parameters in the vmcache arms' domain metadata, KEY=VALUE,... (default: none, the "
                        "product's defaults; e.g. decay=0.7)")
    p.add_argument("--min-mib", type=int, default=0,
                   help="min= in the vmcache arms' domain metadata: MiB of the host's pinned cap guaranteed to each "
                        "(default 0: none, the product's default; the alternating pair's equal split is 112)")
    p.add_argument("--host-setting", action="append", default=[], metavar="KEY=VALUE",
                   help="a host config setting for the vmcache arms' agents over the installed config, e.g. "
                        "fill=cached (repeat; written to the run's host.yaml; the pair's config gets it too)")
    _scenario_arguments(p)
    args = p.parse_args()
    arms = every_arm()
    if args.arms:
        unknown = set(args.arms.split(",")) - set(arms)
        if unknown:
            p.error(f"unknown arms: {', '.join(sorted(unknown))} (scenario-device-mode: "
                    f"{'|'.join(SCENARIOS)}-{'|'.join(DEVICES)}-evicted|kernel|vmcache|oracle|warm|partition, "
                    f"the modes a scenario can run in)")
        args.selected = [arms[n] for n in args.arms.split(",")]
    else:
        args.selected = list(SETS[args.set])
    return args


def _scenario_arguments(p: argparse.ArgumentParser) -> None:
    """The guest's, the neighbours' and the scenarios' settings, and where the run's files go."""
    p.add_argument("--disk-gib", type=int, default=2, help="image size (default 2 GiB)")
    p.add_argument("--memory-mib", type=int, default=384, help="guest RAM (default 384)")
    p.add_argument("--neighbour-gib", type=int, default=2,
                   help="size of the neighbours' sparse file (default 2 GiB, 4x the cache)")
    p.add_argument("--stream-rate", default="100m", help="streaming neighbour's rate, fio --rate (default 100m)")
    p.add_argument("--reuse-iops", type=int, default=10000,
                   help="reuse neighbour's 4 KiB random reads per second (default 10000)")
    p.add_argument("--reclaim-period", type=float, default=10.0,
                   help="reclaim scenario: seconds between memory.force_empty (default 10)")
    p.add_argument("--phase", type=int, default=60,
                   help="alternate: seconds each VM is busy, then idle (default 60)")
    p.add_argument("--pair-cache-mib", type=int, default=320,
                   help="alternate: cache room of the two VMs together, parent limit = both QEMUs' anon + this "
                        "(default 320: one 205 MiB hot set fits, two do not)")
    p.add_argument("--pair-cap-mib", type=int, default=224,
                   help="alternate: pinned_cap of the host config the two agents share (default 224: the room "
                        "less the agents' own memory)")
    p.add_argument("--trace-requests", type=int, default=e2e_trace.REQUESTS,
                   help=f"trace scenarios: replay this many requests from the trace's start, or all that fit the disk "
                        f"if fewer (default {e2e_trace.REQUESTS}: ~2 minutes a run; 0: all that fit)")
    p.add_argument("--log-device-reads", action="store_true",
                   help="the delay device logs every read it serves to each run's device-reads.log (diagnosis)")
    p.add_argument("--dir", default="/var/lib/vmcache/bench-e2e", help="where the image goes (removed after)")
    p.add_argument("--keep-image", action="store_true", help="keep the image for the next run")
    p.add_argument("--guest-dir", default="/var/lib/vmcache/guest")
    p.add_argument("--out", default=".bench", help="raw results go to OUT/e2e-<time>/")


def references(arms: list[Arm]) -> dict[str, str]:
    """Each arm's reference: its group's kernel arm, or its evicted arm where the group has no kernel arm."""
    names = {a.name for a in arms}
    out = {}
    for a in arms:
        for mode in ("kernel", "evicted"):
            ref = f"{a.group}-{mode}"
            if ref in names:
                out[a.name] = ref
                break
    return out


CHECKS = (   # case, fio arguments: 4 KiB requests, psync, the page cache kept (invalidate=0)
    ("miss", ["--rw=randread"]),                                   # over the whole cold image
    ("miss_32", ["--rw=randread", "--numjobs=32", "--group_reporting"]),  # 32 at once, like QD32
    ("hit", ["--rw=randread", f"--size={64 * MIB}"]),              # 64 MiB read in before
    ("sync_write", ["--rw=randwrite", f"--size={64 * MIB}", "--sync=1"]),
)


def check_device(name: str, s: Settings) -> dict:
    """Host-side fio in the bench's memory cgroup on the image as the arms open it: misses, hits, O_SYNC writes."""
    dev = DEVICES[name]
    cg = Cgroup("memory", "vmcache-bench-e2e-check")
    cg.create()
    out = {}
    daemon = None
    try:
        if dev.delayed:
            warm(s.disk)
            daemon = mount_delay(dev, s.disk.parent, s.mount, s.out / "delaydev-check.json")
        path = s.mount / s.disk.name if dev.delayed else s.disk
        for case, extra in CHECKS:
            evict(path)
            if case == "hit":
                run(["vmtouch", "-q", "-t", "-p", f"0-{64 * MIB}", str(path)])
            argv = ["fio", f"--name={case}", f"--filename={path}", "--bs=4k", "--ioengine=psync", "--invalidate=0",
                    "--time_based", "--runtime=3", "--output-format=json", *extra]
            done = run(["sh", "-c", cg.shell_prefix() + "exec " + " ".join(argv)])
            job = json.loads(done.stdout[done.stdout.find("{"):])["jobs"][0]
            side = job["write" if case == "sync_write" else "read"]
            out[case] = {"iops": round(side["iops"]), "lat_mean_us": round(side["lat_ns"]["mean"] / 1000, 1),
                         "lat_p50_us": round(side["clat_ns"]["percentile"]["50.000000"] / 1000, 1),
                         "lat_p99_us": round(side["clat_ns"]["percentile"]["99.000000"] / 1000, 1)}
    finally:
        if daemon is not None:
            unmount_delay(daemon, s.mount)
        evict(s.disk)
        cg.remove()
    log(device_check_line(dev.describe(), out))
    return out


def machine() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?")
    mem = next(ln.split()[1] for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal"))
    return {"cpu": cpu, "cpus": os.cpu_count(), "mem_gib": round(int(mem) / (1 << 20), 1),
            "kernel": platform.release(), "qemu": run(["qemu-system-x86_64", "--version"]).stdout.splitlines()[0],
            "libvirt": run(["libvirtd", "--version"]).stdout.strip(),
            "commit": run(["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "--short", "HEAD"],
                          check=False).stdout.strip()}


def make_files(s: Settings, arms: list[Arm], disk_gib: int, neighbour_gib: int, trace_requests: int) -> None:
    """The images (a second one for the alternating pair), the neighbours' file, the traces' initramfs and
    the agents' host configs."""
    for i in range(max(a.scenario.vms for a in arms)):
        disk = s.image(i)
        if not disk.exists() or disk.stat().st_size != s.disk_bytes or disk.stat().st_blocks * 512 < s.disk_bytes:
            log(f"writing a fully allocated {disk_gib} GiB raw image {disk}")
            run(["dd", "if=/dev/zero", f"of={disk}", "bs=4M", f"count={s.disk_bytes // (4 * MIB)}",
                 "oflag=direct", "status=none"])
    if any(a.scenario.neighbour for a in arms):
        with open(s.neighbour_file, "wb") as f:
            f.truncate(neighbour_gib << 30)
    write_host_configs(s, arms)
    for name in sorted({a.scenario.trace for a in arms if a.scenario.trace}):
        s.traces[name] = prepare_trace(name, s, trace_requests)


def installed_config() -> dict:
    """The installed host config's settings; none where nothing is installed (the agents' defaults)."""
    try:
        return yaml.safe_load(Path(HOST_CONFIG).read_text()) or {}
    except FileNotFoundError:
        return {}


def write_host_configs(s: Settings, arms: list[Arm]) -> None:
    """The host configs of the arms' agents where they are not the installed one: with ``--host-setting``s,
    the pair's (one shared cap), a mode's own settings (MODE_HOST_SETTINGS) over either."""
    installed = installed_config()
    if s.host_settings:
        s.host_config = s.out / "host.yaml"
        s.host_config.write_text(yaml.safe_dump({**installed, **s.host_settings}))
    # The pair's agents: the installed defaults, one shared cap.
    pair = {"pinned_cap": f"{s.pair_cap_mib}M", **s.host_settings}
    if any(a.scenario.vms > 1 and a.mode in AGENT_MODES for a in arms):
        s.pair_config = s.out / "host-pair.yaml"
        s.pair_config.write_text(yaml.safe_dump(pair))
    for mode, paired in {(a.mode, a.scenario.vms > 1) for a in arms if a.mode in MODE_HOST_SETTINGS}:
        path = s.out / f"host-{'pair-' if paired else ''}{mode}.yaml"
        base = pair if paired else {**installed, **s.host_settings}
        path.write_text(yaml.safe_dump({**base, **MODE_HOST_SETTINGS[mode]}))
        s.mode_configs[mode, paired] = path


def prepare_trace(name: str, s: Settings, limit: int) -> TraceFiles:
    """The trace's warm-up and measured iologs in an initramfs beside the guest's, and the oracle's blocks."""
    r = e2e_trace.replay(e2e_trace.load(e2e_trace.TRACES[name]), s.disk_bytes, e2e_trace.WARMUP_SHARE,
                         s.budget_mib * MIB, limit)
    initrd = initrd_with(Path(s.guest_dir) / "initramfs.cpio", {"trace/1.iolog": r.warmup, "trace/2.iolog": r.measured},
                         s.out / f"trace-{name}.cpio")
    ranges = s.out / f"trace-{name}-oracle.txt"
    ranges.write_text("".join(f"{start} {length}\n" for start, length in r.oracle))
    log(f"trace {name}: {r.requests[0]} + {r.requests[1]} requests (trace time {r.trace_seconds[0]:.0f} + "
        f"{r.trace_seconds[1]:.0f} s) mapped onto {r.disk_used / MIB:.0f} MiB; oracle: {len(r.oracle)} runs, "
        f"{sum(n for _, n in r.oracle) / MIB:.0f} MiB")
    return TraceFiles(initrd, ranges, sum(n for _, n in r.oracle), r.requests, r.trace_seconds)


def run_rounds(arms: list[Arm], s: Settings, rounds: int, runs: list[dict]) -> None:
    """Every arm once per round, the order rotated from round to round (``round_order``); each run's row,
    with its ``slot`` in the round, appended to ``runs`` as it ends. A warm set is learnt before round 1."""
    warm_devices = sorted({a.device for a in arms if a.mode == "warm"})
    if len(warm_devices) > 1:
        raise SystemExit("warm arms on more than one device: the saved hot set names one image path")
    if warm_devices:
        # What an earlier vmcache run of the guest saved, on the same device: the hot set names the
        # image's path (the delay device's mount, or the real disk's).
        with hook_lock():
            s.hotset = learn_hotset(warm_devices[0], s)
    for round_ in range(1, rounds + 1):
        order = round_order(arms, round_)
        log(f"round {round_}/{rounds}, in this order: {', '.join(a.name for a in order)}")
        for slot, arm in enumerate(order, 1):
            log(f"round {round_}/{rounds}: {arm.name}")
            if arm.mode in AGENT_MODES:
                with hook_lock():   # no live test swaps the hook under this arm
                    res = run_arm(arm, s, round_)
                    if host_config(arm, s) != HOST_CONFIG:
                        ensure_hook(HOST_CONFIG)   # the installed hook back, before another user's turn
            else:
                res = run_arm(arm, s, round_)
            row = {**asdict(res), "slot": slot, "figures": figures(res.fio), "pinned_end": None}
            if res.steady_fio is not None:
                row["figures"]["steady_iops"] = figures([res.steady_fio])["iops"]
                row["figures"]["t90_seconds"] = time_to_steady(res.cgroup_samples, row["figures"]["steady_iops"])
            row["figures"].update(miss_figures(res.device_read_bytes, sum(j["read"]["total_ios"] for j in res.fio),
                                               sum(j["write"]["total_ios"] for j in res.fio)))
            statuses = [a["status"] for a in res.agents if a.get("status")]
            if statuses:
                row["pinned_end"] = sum(d.get("pinned_bytes", 0) for st in statuses for d in st.get("disks", []))
            runs.append(row)
            if res.ok:
                log(f"{arm.name}: {row['figures']['iops']:.0f} IOPS, load {res.load.get('end', '?')}")


def report(arms: list[Arm], runs: list[dict], meta: dict, out: Path) -> None:
    checks = "\n".join(f"- {device_check_line(DEVICES[d].describe(), c)}" for d, c in meta["device_checks"].items())
    text = "\n\n".join([f"`{meta['command']}`, {meta['started']} - {meta['finished']} UTC, "
                        f"commit {meta['machine']['commit']}",
                        checks, goal_table(GOALS, runs), arm_table([a.name for a in arms], runs, references(arms)),
                        boot_table([a.name for a in arms if a.scenario.boot], runs)])
    (out / "summary.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    (out / "table.md").write_text(text + "\n")
    print("\n" + text + f"\n\nraw results: {out}")


def main() -> int:
    args = parse_args()
    libvirt.registerErrorHandler(lambda _ctx, _err: None, None)  # destroying a domain already gone is fine
    if os.geteuid() != 0:
        print("e2e: run as root", file=sys.stderr)
        return 2
    work = Path(args.dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out).resolve() / time.strftime("e2e-%Y%m%d-%H%M%S")
    out.mkdir(parents=True)
    s = Settings(runtime=args.runtime, warmup=args.warmup, slow_warmup=args.slow_warmup, gap=args.gap,
                 cache_mib=args.cache_mib, budget_mib=args.budget_mib, disk=work / "disk.raw",
                 disk_bytes=args.disk_gib << 30, mount=work / "delay", neighbour_file=work / "neighbour.sparse",
                 stream_rate=args.stream_rate, reuse_iops=args.reuse_iops,
                 reclaim_period=args.reclaim_period, out=out, guest_dir=args.guest_dir, memory_mib=args.memory_mib,
                 model=dict(kv.split("=", 1) for kv in args.model.split(",") if kv), phase=args.phase,
                 pair_cache_mib=args.pair_cache_mib, pair_cap_mib=args.pair_cap_mib,
                 log_reads=args.log_device_reads, min_mib=args.min_mib,
                 host_settings={k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in args.host_setting)})

    def on_signal(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_signal)

    arms = args.selected
    runs: list[dict] = []
    meta = {"command": " ".join(sys.argv), "settings": {k: str(v) for k, v in asdict(s).items()},
            "machine": machine(), "started": time.strftime("%Y-%m-%d %H:%M"), "device_checks": {}}
    try:
        destroy_ours()
        make_files(s, arms, args.disk_gib, args.neighbour_gib, args.trace_requests)
        for device in sorted({a.device for a in arms}):
            meta["device_checks"][device] = check_device(device, s)
        seconds = sum(guest_seconds(a, s) + 15 for a in arms)
        log(f"{len(arms)} arms x {args.rounds} rounds, about {seconds * args.rounds // 60} min; "
            f"raw results in {out}")
        run_rounds(arms, s, args.rounds, runs)
    except KeyboardInterrupt:
        log("interrupted: cleaning up")
    finally:
        destroy_ours()
        if s.pair_config is not None or s.host_config is not None or s.mode_configs:
            with hook_lock():
                ensure_hook(HOST_CONFIG)
        unmount_delay(None, s.mount)   # an arm's own cleanup unmounts; this catches one cut short
        s.neighbour_file.unlink(missing_ok=True)
        if not args.keep_image:
            for i in range(max(a.scenario.vms for a in arms)):
                s.image(i).unlink(missing_ok=True)
            try:
                work.rmdir()
            except OSError:
                pass
        meta["finished"] = time.strftime("%H:%M")
        report(arms, runs, meta, out)
    return 0 if runs and all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
