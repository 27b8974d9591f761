"""End-to-end benchmark (`make bench`): a real libvirt guest running fio, per arm.

Every arm boots the tiny test guest (scripts/build-guest.sh) as a transient
libvirt domain (``type='qemu'``, TCG) on one fully allocated raw image with
``cache='writethrough'``, and reads fio's JSON from its serial console.

Memory accounting (docs/benchmarks.md, "End to end"): each arm runs in a
fresh memory cgroup v1, ``/sys/fs/cgroup/memory/vmcache-bench-e2e``. The
domain is started paused, QEMU is moved into the cgroup, and only then is
the guest resumed, so every page-cache page the guest's I/O brings in is
charged there. The vmcache agent (started by the installed libvirt hook,
from the domain's metadata), vmtouch (oracle / static preload) and the noisy
neighbour are moved in too. Once the guest is up, the limit is set to
QEMU's anonymous memory (guest RAM + TCG, measured per arm) plus
``--cache-mib``: the page cache every arm can use is that, minus whatever
the other tenants of the cgroup (the agent's own RSS, locked pages) take.

Arms (selected with --arms, default all):

  zoned-qd1-*   fio zoned:90/10:10/90, QD1 psync sync=1
  zipf-qd1-*    fio zipf:1.2, QD1
  *-qd32-*      the same with libaio iodepth 32
  noisy-*       zoned QD1 while a host process streams a large file through
                the same cgroup's page cache
  moving-*      zoned on the first 10% (warm-up), then on 50-60% (measured)

and the mode suffix: ``evicted`` (image dropped from the cache, measured
from boot, no warm-up), ``kernel`` (no agent), ``vmcache`` (opted in
through metadata), ``oracle`` / ``static`` (first 10% of the image locked
with ``vmtouch -l`` before the guest starts).

Run as root with the repository's venv, after scripts/bench.sh set things
up::

    .venv/bin/python bench/e2e.py [--runtime 60] [--arms a,b]

Raw results (fio JSON, console logs, samples) go to .bench/e2e-<time>/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.lab import GuestSpec, domain_xml, fio_results  # noqa: E402
from vmcache.settings.metadata import DomainSettings  # noqa: E402
from vmcache.observe.status import file_stem  # noqa: E402

MIB = 1 << 20
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
CGROUP = CGROUP_ROOT / "vmcache-bench-e2e"
PREFIX = "vmcache-bench-e2e-"
AGENTS_DIR = Path("/run/vmcache/agents")
REPO = Path(__file__).resolve().parent.parent
HOOK = Path("/etc/libvirt/hooks/qemu")
HOOK_PYTHON = "/opt/vmcache/venv/bin/python"
HOST_CONFIG = "/etc/vmcache/vmcache.yaml"
QEMU_PIDS = Path("/run/libvirt/qemu")
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Arm:
    name: str
    workload: str          # guest workload: zoned, zipf, moving
    qd: int
    mode: str              # evicted, kernel, vmcache, oracle, static
    noise: bool = False
    baseline: str = ""     # arm the ratio is taken against ("" = none)


def all_arms() -> list[Arm]:
    arms = []
    for wl in ("zoned", "zipf"):
        modes = ("evicted", "kernel", "vmcache", "oracle") if wl == "zoned" else ("evicted", "kernel", "vmcache")
        for mode in modes:
            arms.append(Arm(f"{wl}-qd1-{mode}", wl, 1, mode, baseline=f"{wl}-qd1-kernel"))
    for wl in ("zoned", "zipf"):
        for mode in ("kernel", "vmcache"):
            arms.append(Arm(f"{wl}-qd32-{mode}", wl, 32, mode, baseline=f"{wl}-qd32-kernel"))
    for mode in ("kernel", "vmcache"):
        arms.append(Arm(f"noisy-qd1-{mode}", "zoned", 1, mode, noise=True, baseline="noisy-qd1-kernel"))
    for mode in ("kernel", "static", "vmcache"):
        arms.append(Arm(f"moving-qd1-{mode}", "moving", 1, mode, baseline="moving-qd1-kernel"))
    return arms


# Goals of issue 6: (label, arm, reference arm, minimum ratio of total IOPS).
GOALS = [
    ("vmcache vs kernel only, noisy neighbour, QD1 sync", "noisy-qd1-vmcache", "noisy-qd1-kernel", 1.3),
    ("vmcache vs static oracle, fixed hot spot (zoned QD1)", "zoned-qd1-vmcache", "zoned-qd1-oracle", 0.9),
    ("vmcache vs static preload, hot spot moved", "moving-qd1-vmcache", "moving-qd1-static", 1.2),
    ("vmcache vs kernel only, QD32 zoned (no harm)", "zoned-qd32-vmcache", "zoned-qd32-kernel", 0.97),
    ("vmcache vs kernel only, QD32 zipf (no harm)", "zipf-qd32-vmcache", "zipf-qd32-kernel", 0.97),
]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(argv: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=check, stdin=subprocess.DEVNULL, capture_output=True, text=True, **kw)


# ---------------------------------------------------------------- cgroup

def cg_write(name: str, value: str | int, cg: Path = CGROUP) -> None:
    (cg / name).write_text(f"{value}\n")


def cg_stat(cg: Path = CGROUP) -> dict[str, int]:
    out = {}
    for line in (cg / "memory.stat").read_text().splitlines():
        key, _, value = line.partition(" ")
        out[key] = int(value)
    return out


def cg_join(pid: int, cg: Path = CGROUP) -> bool:
    """Move process ``pid`` (all its threads) into ``cg``; False if it is gone."""
    try:
        cg_write("cgroup.procs", pid, cg)
        return True
    except (ProcessLookupError, FileNotFoundError):
        return False
    except OSError as err:
        if err.errno == 3:  # ESRCH
            return False
        raise


def cg_create() -> None:
    cg_remove()
    CGROUP.mkdir()


def cg_remove() -> None:
    if not CGROUP.exists():
        return
    for _ in range(100):
        pids = [p for p in (CGROUP / "cgroup.procs").read_text().split()]
        for pid in pids:  # anything still inside goes back to the root cgroup
            cg_join(int(pid), CGROUP_ROOT)
        try:
            CGROUP.rmdir()
            return
        except OSError:
            time.sleep(0.1)
    log(f"warning: could not remove {CGROUP}")


# ---------------------------------------------------------------- /proc

def proc_status(pid: int) -> dict[str, str]:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


def kib(status: dict[str, str], key: str) -> int:
    value = status.get(key, "0 kB").split()
    return int(value[0]) if value else 0


def cpu_seconds(pid: int) -> float | None:
    try:
        fields_ = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields_[11]) + int(fields_[12])) / CLK_TCK  # utime, stime


def alive(pid: int | None) -> bool:
    return pid is not None and Path(f"/proc/{pid}").exists()


# ---------------------------------------------------------------- libvirt

def virsh(*args: str, check: bool = False) -> subprocess.CompletedProcess:
    done = run(["virsh", "-q", *args], check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"virsh {' '.join(args)}: {done.stderr.strip()}")
    return done


def ensure_libvirtd() -> None:
    """Others restart libvirtd on shared hosts: start it again when it is gone."""
    if virsh("version").returncode != 0:
        log("libvirtd does not answer: scripts/libvirtd.sh")
        run([str(REPO / "scripts" / "libvirtd.sh")], check=False)


def create(xml_path: Path) -> None:
    """virsh create --paused, retried while libvirtd is restarting."""
    for attempt in range(5):
        ensure_libvirtd()
        done = virsh("create", "--paused", str(xml_path))
        if done.returncode == 0:
            return
        if "Disconnected" not in done.stderr and "connect" not in done.stderr.lower():
            break
        time.sleep(3)
    raise RuntimeError(f"virsh create: {done.stderr.strip()}")


def destroy_ours() -> None:
    out = virsh("list", "--all", "--name").stdout.split()
    for name in out:
        if name.startswith(PREFIX):
            virsh("destroy", name)
            virsh("undefine", name)


def agent_pid(domain: str) -> int | None:
    """The agent process of ``domain`` (``... agent ... --domain NAME``), found in /proc."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        for i, arg in enumerate(argv[:-1]):
            if arg == b"--domain" and argv[i + 1] == domain.encode() and b"agent" in argv:
                return int(entry.name)
    return None


def agent_cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def ensure_hook() -> None:
    """The operator's hook (make install) must be the one libvirt runs.

    Live tests on a shared host install their own hook at the same path for
    a while; put the installed one back when it is not there.
    """
    try:
        text = HOOK.read_text()
    except OSError:
        text = ""
    if f"VMCACHE_PYTHON={HOOK_PYTHON}\n" in text and f"VMCACHE_CONFIG={HOST_CONFIG}\n" in text:
        return
    log(f"{HOOK} is not the installed vmcache hook (someone replaced it): reinstalling it")
    run([str(REPO / "scripts" / "install.sh"), "--hook-only", "--python", HOOK_PYTHON, "--config", HOST_CONFIG],
        check=False, cwd=REPO)


def agent_status(domain: str) -> dict | None:
    try:
        return json.loads((AGENTS_DIR / f"{file_stem(domain)}.json").read_text())
    except (OSError, ValueError):
        return None


def pinned_bytes(status: dict | None) -> int | None:
    if not status:
        return None
    return sum(d.get("pinned_bytes", 0) for d in status.get("disks", []))


# ---------------------------------------------------------------- one arm

@dataclass
class Settings:
    runtime: int
    warmup: int
    cache_mib: int
    budget_mib: int
    disk: Path
    disk_bytes: int
    noise_file: Path
    noise_rate: str
    out: Path
    guest_dir: str
    memory_mib: int
    model: dict


@dataclass
class ArmResult:
    arm: str
    ok: bool
    error: str | None = None
    fio: dict | None = None            # the measured fio run (jobs[0])
    warmup_fio: dict | None = None
    limit_bytes: int = 0
    qemu_anon_bytes: int = 0
    cgroup_peak_bytes: int = 0
    cgroup_samples: list = field(default_factory=list)
    agent: dict | None = None          # pid, cpu_percent, peak_rss_bytes, status at end
    oracle_locked_bytes: int = 0
    wall_seconds: float = 0.0


def hot_range(s: Settings) -> int:
    """Bytes of the first hot range (the first 10% of the image), page aligned."""
    return (s.disk_bytes // 10) // 4096 * 4096


def start_locker(s: Settings, length: int) -> subprocess.Popen:
    """vmtouch -l on [0, length) of the image, inside the cgroup; waits until locked."""
    proc = subprocess.Popen(
        ["sh", "-c", f"echo $$ > {CGROUP}/cgroup.procs && exec vmtouch -q -l -m 64G -p 0-{length} {s.disk}"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vmtouch exited: {proc.stderr.read().decode(errors='replace')}")
        if kib(proc_status(proc.pid), "VmLck") * 1024 >= length - 4096:
            return proc
        time.sleep(0.2)
    raise RuntimeError("vmtouch did not lock the range within 120 s")


def start_noise(s: Settings) -> subprocess.Popen:
    """A host process streaming a large file through the page cache, in the cgroup."""
    argv = ["fio", "--name=noise", f"--filename={s.noise_file}", "--rw=read", "--bs=1M",
            "--ioengine=psync", "--invalidate=1", "--time_based", "--runtime=3600",
            f"--rate={s.noise_rate}", "--output-format=terse"]
    return subprocess.Popen(
        ["sh", "-c", f"echo $$ > {CGROUP}/cgroup.procs && exec " + " ".join(argv)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_arm(arm: Arm, s: Settings) -> ArmResult:
    name = PREFIX + arm.name
    res = ArmResult(arm=arm.name, ok=False)
    adir = s.out / arm.name
    adir.mkdir(parents=True, exist_ok=True)
    console = adir / "console.log"
    console.write_text("")
    loops = 1 if arm.mode == "evicted" else 2
    settings = DomainSettings(budget=s.budget_mib * MIB, model=s.model) if arm.mode == "vmcache" else None
    spec = GuestSpec(name=name, disk=str(s.disk), console_log=str(console), guest_dir=s.guest_dir,
                     workload=arm.workload, qd=arm.qd, loops=loops, memory_mib=s.memory_mib,
                     runtime=s.runtime, settings=settings)
    xml = domain_xml(spec)
    (adir / "domain.xml").write_text(xml)

    locker = noise = None
    apid = None
    t0 = time.monotonic()
    try:
        run(["vmtouch", "-q", "-e", str(s.disk)])   # every arm starts cold
        cg_create()
        if arm.mode in ("oracle", "static"):
            locker = start_locker(s, hot_range(s))
            res.oracle_locked_bytes = kib(proc_status(locker.pid), "VmLck") * 1024
            log(f"{arm.name}: vmtouch locked {res.oracle_locked_bytes / MIB:.0f} MiB (first 10% of the image)")
        xml_path = adir / "domain.xml"
        if arm.mode == "vmcache":
            ensure_hook()
        create(xml_path)
        qpid = int((QEMU_PIDS / f"{name}.pid").read_text().strip())
        cg_join(qpid)
        if arm.mode == "vmcache":
            deadline = time.monotonic() + 20
            while apid is None and time.monotonic() < deadline:
                apid = agent_pid(name)
                if apid is None:
                    time.sleep(0.02)
            if apid is None:
                raise RuntimeError("the hook started no agent within 20 s")
            cg_join(apid)
            res.agent = {"pid": apid, "cmdline": agent_cmdline(apid)}
            log(f"{arm.name}: agent pid {apid} joined the cgroup: {res.agent['cmdline']}")
            if f"--host-config {HOST_CONFIG} " not in res.agent["cmdline"] + " ":
                raise RuntimeError(f"the agent runs with another host config: {res.agent['cmdline']}")
        virsh("resume", name, check=True)

        # Guest up: wait for QEMU's anonymous memory to settle, then set the limit.
        deadline = time.monotonic() + 120
        while "VMCACHE-GUEST-READY" not in console.read_text(errors="replace"):
            if time.monotonic() > deadline or not alive(qpid):
                raise RuntimeError("guest did not come up")
            time.sleep(0.2)
        prev = -1
        for _ in range(30):
            anon = kib(proc_status(qpid), "RssAnon") * 1024
            if abs(anon - prev) < 2 * MIB:
                break
            prev = anon
            time.sleep(0.5)
        res.qemu_anon_bytes = anon
        res.limit_bytes = anon + s.cache_mib * MIB
        cg_write("memory.limit_in_bytes", res.limit_bytes)
        log(f"{arm.name}: QEMU anon {anon / MIB:.0f} MiB, cgroup limit {res.limit_bytes / MIB:.0f} MiB")
        if arm.noise:
            noise = start_noise(s)

        # Run: sample the agent and the cgroup once a second until the guest is done.
        cpu0 = t_cpu0 = None
        cpu_last = t_last = None
        peak_rss = peak_anon = 0
        timeout = time.monotonic() + 60 + (s.runtime + (s.warmup if loops == 2 else 0)) * 1.5 + 120
        measured_marker = f"VMCACHE-FIO-BEGIN {loops}"
        while alive(qpid):
            if time.monotonic() > timeout:
                raise RuntimeError("guest did not finish in time")
            text = console.read_text(errors="replace")
            measuring = measured_marker in text
            if apid is not None and alive(apid):
                st = proc_status(apid)
                peak_rss = max(peak_rss, kib(st, "VmHWM") * 1024)
                peak_anon = max(peak_anon, kib(st, "RssAnon") * 1024)
                c = cpu_seconds(apid)
                if c is not None:
                    if measuring and cpu0 is None:
                        cpu0, t_cpu0 = c, time.monotonic()
                    if measuring and f"VMCACHE-FIO-END {loops}" not in text:
                        cpu_last, t_last = c, time.monotonic()
            stat = cg_stat()
            usage = int((CGROUP / "memory.usage_in_bytes").read_text())
            res.cgroup_samples.append({
                "t": round(time.monotonic() - t0, 1), "measuring": measuring, "usage": usage,
                "cache": stat.get("cache", 0), "rss": stat.get("rss", 0),
                "unevictable": stat.get("unevictable", 0),
                "pinned": pinned_bytes(agent_status(name)) if apid else None,
            })
            if "VMCACHE-GUEST-DONE" in text:
                break
            time.sleep(1)
        res.cgroup_peak_bytes = int((CGROUP / "memory.max_usage_in_bytes").read_text())
        if apid is not None:
            cpu_pct = None
            if cpu0 is not None and t_last is not None and t_last > t_cpu0:
                cpu_pct = 100.0 * (cpu_last - cpu0) / (t_last - t_cpu0)
            res.agent.update({"cpu_percent": cpu_pct, "peak_rss_bytes": peak_rss, "peak_anon_bytes": peak_anon,
                              "status": agent_status(name)})
        results = fio_results(console.read_text(errors="replace"))
        if len(results) < loops:
            raise RuntimeError(f"{len(results)} fio results on the console, expected {loops}")
        res.fio = results[-1]["jobs"][0]
        if loops == 2:
            res.warmup_fio = results[0]["jobs"][0]
        res.ok = True
    except Exception as err:  # noqa: BLE001 - one arm's failure must not stop the others
        res.error = f"{type(err).__name__}: {err}"
        log(f"{arm.name}: FAILED {res.error}")
    finally:
        stop(noise)
        virsh("destroy", name)
        stop(locker)
        if apid is not None:  # the hook stops the agent on release; give it time
            for _ in range(100):
                if not alive(apid):
                    break
                time.sleep(0.1)
            if alive(apid) and agent_pid(name) == apid:
                log(f"{arm.name}: the agent outlived its domain: SIGTERM {apid}")
                os.kill(apid, signal.SIGTERM)
        cg_remove()
        res.wall_seconds = time.monotonic() - t0
        (adir / "result.json").write_text(json.dumps(asdict(res), indent=1))
    return res


# ---------------------------------------------------------------- report

def figures(job: dict | None) -> dict:
    if not job:
        return {}
    out = {}
    for d in ("read", "write"):
        j = job[d]
        pct = j.get("clat_ns", {}).get("percentile", {})
        out[f"{d}_iops"] = j["iops"]
        out[f"{d}_lat_mean_us"] = j["lat_ns"]["mean"] / 1000
        out[f"{d}_lat_p99_us"] = pct.get("99.000000", 0) / 1000
    out["iops"] = out["read_iops"] + out["write_iops"]
    return out


def table(arms: list[Arm], results: dict[str, ArmResult]) -> str:
    head = ("| arm | read IOPS | write IOPS | read mean / p99 (us) | write mean / p99 (us) "
            "| x kernel only | agent CPU % | agent peak RSS / anon (MiB) |")
    lines = [head, "|" + "---|" * 8]
    for arm in arms:
        r = results.get(arm.name)
        if r is None:
            continue
        if not r.ok:
            lines.append(f"| {arm.name} | failed: {r.error} | | | | | | |")
            continue
        f = figures(r.fio)
        base = results.get(arm.baseline)
        ratio = ""
        if base is not None and base.ok:
            ratio = f"{f['iops'] / figures(base.fio)['iops']:.2f}"
        cpu = rss = ""
        if r.agent:
            cpu = f"{r.agent['cpu_percent']:.1f}" if r.agent.get("cpu_percent") is not None else "?"
            rss = f"{r.agent['peak_rss_bytes'] / MIB:.0f} / {r.agent['peak_anon_bytes'] / MIB:.0f}"
        lines.append(
            f"| {arm.name} | {f['read_iops']:.0f} | {f['write_iops']:.0f} "
            f"| {f['read_lat_mean_us']:.0f} / {f['read_lat_p99_us']:.0f} "
            f"| {f['write_lat_mean_us']:.0f} / {f['write_lat_p99_us']:.0f} | {ratio} | {cpu} | {rss} |")
    return "\n".join(lines)


def goals(results: dict[str, ArmResult]) -> str:
    lines = ["| goal | ratio | target | met |", "|---|---|---|---|"]
    for label, a, b, target in GOALS:
        ra, rb = results.get(a), results.get(b)
        if not (ra and rb and ra.ok and rb.ok):
            continue
        ratio = figures(ra.fio)["iops"] / figures(rb.fio)["iops"]
        lines.append(f"| {label} | {ratio:.2f} | >= {target} | {'yes' if ratio >= target else 'NO'} |")
    return "\n".join(lines)


def machine() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?")
    mem = next(ln.split()[1] for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal"))
    return {"cpu": cpu, "cpus": os.cpu_count(), "mem_gib": round(int(mem) / (1 << 20), 1),
            "kernel": platform.release(), "qemu": run(["qemu-system-x86_64", "--version"]).stdout.splitlines()[0],
            "libvirt": run(["libvirtd", "--version"]).stdout.strip(),
            "loadavg": Path("/proc/loadavg").read_text().strip()}


# ---------------------------------------------------------------- main

def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runtime", type=int, default=60,
                   help="seconds of each fio run (default 60); every arm but 'evicted' runs fio twice, "
                        "a warm-up and the measured run")
    p.add_argument("--cache-mib", type=int, default=512,
                   help="page cache every arm may use: cgroup limit = QEMU anon + this (default 512)")
    p.add_argument("--budget-mib", type=int, default=256, help="vmcache budget in the domain metadata (default 256)")
    p.add_argument("--model", default="decay=0.7",
                   help="model parameters in the vmcache arms' domain metadata, KEY=VALUE,... "
                        "(default decay=0.7, as make demo)")
    p.add_argument("--disk-gib", type=int, default=2, help="image size (default 2 GiB)")
    p.add_argument("--memory-mib", type=int, default=384, help="guest RAM (default 384)")
    p.add_argument("--noise-gib", type=int, default=8, help="size of the noisy neighbour's sparse file")
    p.add_argument("--noise-rate", default="100m", help="noisy neighbour's read rate, fio --rate (default 100m)")
    p.add_argument("--dir", default="/var/lib/vmcache/bench-e2e", help="where the image goes (removed after)")
    p.add_argument("--keep-image", action="store_true", help="keep the image for the next run")
    p.add_argument("--guest-dir", default="/var/lib/vmcache/guest")
    p.add_argument("--out", default=".bench", help="raw results go to OUT/e2e-<time>/")
    p.add_argument("--arms", default="", help="comma-separated arm names (default all): "
                   + ", ".join(a.name for a in all_arms()))
    args = p.parse_args()
    if os.geteuid() != 0:
        print("e2e: run as root", file=sys.stderr)
        return 2

    arms = all_arms()
    if args.arms:
        wanted = args.arms.split(",")
        unknown = set(wanted) - {a.name for a in arms}
        if unknown:
            p.error(f"unknown arms: {', '.join(sorted(unknown))}")
        arms = [a for a in arms if a.name in wanted]

    work = Path(args.dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out).resolve() / time.strftime("e2e-%Y%m%d-%H%M%S")
    out.mkdir(parents=True)
    s = Settings(runtime=args.runtime, warmup=args.runtime, cache_mib=args.cache_mib, budget_mib=args.budget_mib,
                 disk=work / "disk.raw", disk_bytes=args.disk_gib << 30, noise_file=work / "noise.sparse",
                 noise_rate=args.noise_rate, out=out, guest_dir=args.guest_dir, memory_mib=args.memory_mib,
                 model=dict(kv.split("=", 1) for kv in args.model.split(",") if kv))

    def on_signal(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_signal)

    results: dict[str, ArmResult] = {}
    meta = {"command": " ".join(sys.argv), "settings": {k: str(v) for k, v in asdict(s).items()},
            "machine": machine(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        destroy_ours()
        if not s.disk.exists() or s.disk.stat().st_size != s.disk_bytes or s.disk.stat().st_blocks * 512 < s.disk_bytes:
            log(f"writing a fully allocated {args.disk_gib} GiB raw image {s.disk}")
            run(["dd", "if=/dev/zero", f"of={s.disk}", "bs=4M", f"count={s.disk_bytes // (4 * MIB)}",
                 "oflag=direct", "status=none"])
        if any(a.noise for a in arms):
            with open(s.noise_file, "wb") as f:
                f.truncate(args.noise_gib << 30)
        log(f"{len(arms)} arms, about {len(arms) * (2 * args.runtime + 30) // 60} min; raw results in {out}")
        for arm in arms:
            log(f"{arm.name}: start")
            results[arm.name] = r = run_arm(arm, s)
            if not r.ok and arm.mode == "vmcache" and "agent" in (r.error or ""):
                log(f"{arm.name}: once more (the agent did not come up as installed)")
                results[arm.name] = r = run_arm(arm, s)
            if r.ok:
                f = figures(r.fio)
                log(f"{arm.name}: {f['read_iops']:.0f} read + {f['write_iops']:.0f} write IOPS"
                    + (f", agent CPU {r.agent['cpu_percent'] or 0:.1f}% peak RSS "
                       f"{r.agent['peak_rss_bytes'] / MIB:.0f} MiB" if r.agent else ""))
    except KeyboardInterrupt:
        log("interrupted: cleaning up")
    finally:
        destroy_ours()
        cg_remove()
        s.noise_file.unlink(missing_ok=True)
        if not args.keep_image:
            s.disk.unlink(missing_ok=True)
            try:
                work.rmdir()
            except OSError:
                pass
        meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        meta["loadavg_end"] = Path("/proc/loadavg").read_text().strip()
        summary = {"meta": meta, "arms": {k: {**asdict(v), "figures": figures(v.fio)} for k, v in results.items()}}
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        report = table(arms, results) + "\n\n" + goals(results) + "\n"
        (out / "table.md").write_text(report)
        print()
        print(report)
        print(f"raw results: {out}")
    return 0 if results and all(r.ok for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
