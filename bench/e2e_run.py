"""One arm of the end-to-end bench: boot the guest in its cgroups, run the scenario, collect fio's figures.

Memory: a fresh memory cgroup v1 per arm (``CGROUP``). The domain is started
paused, QEMU moves in, then the guest resumes, so every page its I/O brings
into the cache is charged there; the agent, vmtouch and the neighbour are in
it too. Once the guest is up the limit becomes QEMU's anonymous memory plus
``cache_mib``. Device: on the ``ssd`` and ``hdd`` settings the domain opens
the image through a delay device mounted for the arm (bench/delaydev.py, a
FUSE passthrough under the page cache), so its misses and the agent's cost
the setting's delay while page-cache hits cost nothing; the neighbours read
their sparse file on the real disk (holes cost no device time anyway).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import libvirt

from bench.e2e_arms import SCENARIOS, Arm
from bench.e2e_host import (DEVICES, MIB, Cgroup, Reclaimer, alive, busy_percent, cpu_seconds, cpu_times,
                            delay_stats, evict, kib, loadavg, log, memory_stat, mount_delay, proc_status,
                            read_bytes, run, start_locker, start_reuse, start_stream, stop, unmount_delay, warm)
from tests.lab import GuestSpec, domain_xml, fio_results
from tests.live.livelib import HOOK_LOCK, REPO, destroy_domains, open_conn, qemu_pid, read_status, wait_for
from vmcache.observe.status import file_stem
from vmcache.service.launcher import pidfile_holder
from vmcache.settings.metadata import DomainSettings

PREFIX = "vmcache-bench-e2e-"
CGROUP = Cgroup("memory", "vmcache-bench-e2e")
AGENTS_DIR = Path("/run/vmcache/agents")
HOOK = Path("/etc/libvirt/hooks/qemu")
HOOK_PYTHON = "/opt/vmcache/venv/bin/python"
HOST_CONFIG = "/etc/vmcache/vmcache.yaml"


@dataclass
class Settings:
    runtime: int               # measured fio run, s
    warmup: int                # warm-up fio run, s
    slow_warmup: int           # warm-up on the HDD-class device, s
    gap: int                   # periodic: phase off the hot range, s
    cache_mib: int
    budget_mib: int
    disk: Path                 # the image on the real disk
    disk_bytes: int
    mount: Path                # where the delay device shows the image's directory
    neighbour_file: Path
    stream_rate: str
    reuse_iops: int
    reclaim_period: float
    out: Path
    guest_dir: str
    memory_mib: int
    model: dict
    hotset: str = ""           # the saved hot set element (namespaced) warm arms put in the domain XML


@dataclass
class ArmResult:
    arm: str
    round: int
    ok: bool = False
    error: str | None = None
    fio: list = field(default_factory=list)     # the measured fio runs (jobs[0] each)
    warmup_fio: dict | None = None
    steady_fio: dict | None = None      # boot scenarios: the run after the measured one
    limit_bytes: int = 0
    qemu_anon_bytes: int = 0
    cgroup_peak_bytes: int = 0
    cgroup_samples: list = field(default_factory=list)
    agent: dict | None = None        # pid, cmdline, cpu_percent, peak RSS, status at the end
    oracle_locked_bytes: int = 0
    load: dict = field(default_factory=dict)  # loadavg at start / end of the measured run, host CPU busy %
    reclaims: int = 0
    # bytes fetched from storage in the measured run: qemu and agent (/proc/PID/io) on the real disk,
    # "device" (and "device_requests") from the delay device's counters
    device_read_bytes: dict = field(default_factory=dict)
    wall_seconds: float = 0.0


def warmup(arm: Arm, s: Settings) -> int:
    """Seconds of the first fio run: none for evicted arms, longer where misses are slow."""
    if arm.mode == "evicted" or arm.scenario.boot:
        return s.runtime   # the first run, measured from boot
    return s.slow_warmup if arm.device == "hdd" else s.warmup


@dataclass(frozen=True)
class Plan:
    """How the guest runs for an arm: fio runs in all, and which of them are measured (0-based)."""

    loops: int
    measured: tuple[int, ...]


def plan(arm: Arm) -> Plan:
    if arm.scenario.boot:
        return Plan(2, (0,))     # the first run from boot; the second one gives the steady state
    if arm.mode == "evicted":
        return Plan(1, (0,))
    if arm.scenario.workload == "periodic":
        return Plan(5, (2, 4))   # hot, off, hot, off, hot: the first hot phase warms up
    return Plan(2, (1,))


def hot_range(s: Settings) -> int:
    """Bytes of the hot range (the first 10% of the image), page aligned."""
    return (s.disk_bytes // 10) // 4096 * 4096


@contextmanager
def hook_lock() -> Iterator[None]:
    """The host-wide hook lock of the live tests (tests/live/livelib.py), held while an agent arm runs."""
    os.makedirs(os.path.dirname(HOOK_LOCK), exist_ok=True)
    fd = os.open(HOOK_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def ensure_hook() -> None:
    """The installed hook (make install) must be the one libvirt runs; put it back if someone replaced it."""
    try:
        text = HOOK.read_text()
    except OSError:
        text = ""
    if f"VMCACHE_PYTHON={HOOK_PYTHON}\n" in text and f"VMCACHE_CONFIG={HOST_CONFIG}\n" in text:
        return
    log(f"{HOOK} is not the installed vmcache hook: reinstalling it")
    run([str(REPO / "scripts" / "install.sh"), "--hook-only", "--python", HOOK_PYTHON, "--config", HOST_CONFIG],
        check=False, cwd=REPO)


def connection():
    """A libvirt connection; starts libvirtd (scripts/libvirtd.sh) when it does not answer."""
    conn = open_conn()
    if conn is None:
        log("libvirtd does not answer: scripts/libvirtd.sh")
        run([str(REPO / "scripts" / "libvirtd.sh")], check=False)
        conn = wait_for(open_conn, "libvirtd", timeout=60, step=1)
    return conn


def destroy_ours() -> None:
    destroy_domains(PREFIX)


def agent_pid(domain: str) -> int:
    """The pid of ``domain``'s agent started by the installed hook (its pidfile lock holder); 0 if none."""
    return pidfile_holder(str(AGENTS_DIR / f"{file_stem(domain)}.pid")) or 0


def pinned_bytes(domain: str) -> int | None:
    status = read_status(AGENTS_DIR, domain)
    if not status:
        return None
    return sum(d.get("pinned_bytes", 0) for d in status.get("disks", []))


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


# ---------------------------------------------------------------- steps of an arm

def image(arm: Arm, s: Settings) -> Path:
    """The path the arm's domain (and the agent, the oracle's locker) open the image by."""
    return s.mount / s.disk.name if DEVICES[arm.device].delayed else s.disk


def prepare(arm: Arm, s: Settings, res: ArmResult, procs: list, device: list) -> None:
    """Cold image, fresh cgroup, the delay device (its daemon goes to ``device``); the oracle's locker."""
    dev = DEVICES[arm.device]
    if dev.delayed:
        warm(s.disk)     # the backing file: a miss costs the delay, not the real disk's latency too
        device.append(mount_delay(dev, s.disk.parent, s.mount, s.out / "delaydev.json"))
    evict(image(arm, s))
    CGROUP.create()
    if arm.mode == "oracle":
        procs.append(locker := start_locker(CGROUP, image(arm, s), hot_range(s)))
        res.oracle_locked_bytes = kib(proc_status(locker.pid), "VmLck") * 1024


def boot(arm: Arm, s: Settings, res: ArmResult, console: Path) -> int:
    """Start the domain paused, move QEMU (and the agent) into the cgroups, resume; QEMU's pid."""
    name = PREFIX + arm.name
    p = plan(arm)
    agent = arm.mode in ("vmcache", "warm")
    settings = DomainSettings(budget=s.budget_mib * MIB, model=s.model) if agent else None
    spec = GuestSpec(name=name, disk=str(image(arm, s)), console_log=str(console), guest_dir=s.guest_dir,
                     workload=arm.scenario.workload, qd=arm.scenario.qd, loops=p.loops, memory_mib=s.memory_mib,
                     runtime=s.runtime, warmup=warmup(arm, s),
                     gap=s.gap if arm.scenario.workload == "periodic" else None, settings=settings)
    xml = domain_xml(spec)
    if arm.mode == "warm":
        if not s.hotset:
            raise RuntimeError("no saved hot set to warm from (learn_hotset did not run or saved none)")
        xml = xml.replace("</metadata>", s.hotset + "</metadata>", 1)
    (console.parent / "domain.xml").write_text(xml)
    if agent:
        ensure_hook()
    conn = connection()
    try:
        dom = conn.createXML(xml, libvirt.VIR_DOMAIN_START_PAUSED)
        qpid = qemu_pid(name)
        CGROUP.join(qpid)
        if agent:
            join_agent(name, res)
        dom.resume()
    finally:
        conn.close()
    return qpid


def join_agent(name: str, res: ArmResult) -> None:
    """Find the agent the hook started for ``name`` and move it into the cgroup before the guest runs."""
    apid = wait_for(lambda: agent_pid(name), "the hook to start the agent", timeout=20, step=0.02)
    CGROUP.join(apid)
    res.agent = {"pid": apid, "cmdline": cmdline(apid)}
    if f"--host-config {HOST_CONFIG} " not in res.agent["cmdline"] + " ":
        raise RuntimeError(f"the agent runs with another host config: {res.agent['cmdline']}")


def set_limit(s: Settings, res: ArmResult, qpid: int, console: Path) -> None:
    """Wait for the guest to be up and QEMU's anonymous memory to settle; limit = that + cache_mib."""
    wait_for(lambda: "VMCACHE-GUEST-READY" in console.read_text(errors="replace") or not alive(qpid),
             "the guest to come up", timeout=120, step=0.2)
    if not alive(qpid):
        raise RuntimeError("QEMU exited before the guest came up")
    prev = anon = -1
    for _ in range(30):
        anon = kib(proc_status(qpid), "RssAnon") * 1024
        if abs(anon - prev) < 2 * MIB:
            break
        prev = anon
        time.sleep(0.5)
    res.qemu_anon_bytes = anon
    res.limit_bytes = anon + s.cache_mib * MIB
    CGROUP.write("memory.limit_in_bytes", res.limit_bytes)


def start_neighbour(arm: Arm, s: Settings) -> subprocess.Popen | None:
    if arm.scenario.neighbour == "stream":
        return start_stream(CGROUP, s.neighbour_file, s.stream_rate)
    if arm.scenario.neighbour == "reuse":
        return start_reuse(CGROUP, s.neighbour_file, s.reuse_iops)
    return None


def sample(arm: Arm, s: Settings, res: ArmResult, qpid: int, console: Path,
           on_measuring: Callable[[ArmResult], None] | None = None) -> None:
    """Once a second until the guest is done: cgroup memory, pins, the agent's CPU, the host's load.

    Boot scenarios also sample the guest's requests (QEMU's block stats) for the time to steady IOPS;
    ``on_measuring`` runs once when the measured run begins.
    """
    p = plan(arm)
    ios = _io_counter(PREFIX + arm.name) if arm.scenario.boot else None
    first, last = p.measured[0] + 1, p.measured[-1] + 1
    apid = res.agent["pid"] if res.agent else None
    agent = {"cpu0": None, "cpu1": None, "peak_rss": 0, "peak_anon": 0}
    t_start = time.monotonic()
    runs = warmup(arm, s) + s.runtime * len(p.measured) + s.gap * (p.loops // 2)
    deadline = t_start + 60 + runs * 1.5 + 120
    host0 = None
    stats = s.out / "delaydev.json" if DEVICES[arm.device].delayed else None
    reads0: dict[str, int] = {}
    while alive(qpid):
        if time.monotonic() > deadline:
            raise RuntimeError("the guest did not finish in time")
        text = console.read_text(errors="replace")
        measuring = f"VMCACHE-FIO-BEGIN {first}" in text and f"VMCACHE-FIO-END {last}" not in text
        if measuring and host0 is None:
            if on_measuring is not None:
                on_measuring(res)
            host0, res.load["start"] = cpu_times(), loadavg()
            reads0 = device_reads(qpid, apid, stats)
        if not measuring and host0 is not None and "end" not in res.load:
            res.load["end"] = loadavg()
            res.load["host_busy_percent"] = round(busy_percent(host0, cpu_times()), 1)
            reads1 = device_reads(qpid, apid, stats)
            res.device_read_bytes = {k: reads1[k] - reads0.get(k, 0) for k in reads1}
        if apid is not None and alive(apid):
            sample_agent(apid, agent, measuring)
        stat = memory_stat(CGROUP)
        res.cgroup_samples.append({
            "t": round(time.monotonic() - t_start, 1), "measuring": measuring,
            "usage": int(CGROUP.read("memory.usage_in_bytes")), "cache": stat.get("cache", 0),
            "rss": stat.get("rss", 0), "unevictable": stat.get("unevictable", 0),
            "pinned": pinned_bytes(PREFIX + arm.name) if apid else None,
            "ios": ios() if ios else None,
        })
        if "VMCACHE-GUEST-DONE" in text:
            break
        time.sleep(1)
    if res.agent is not None:
        c0, c1 = agent["cpu0"], agent["cpu1"]
        res.agent.update({
            "cpu_percent": 100.0 * (c1[0] - c0[0]) / (c1[1] - c0[1]) if c0 and c1 and c1[1] > c0[1] else None,
            "peak_rss_bytes": agent["peak_rss"], "peak_anon_bytes": agent["peak_anon"],
            "status": read_status(AGENTS_DIR, PREFIX + arm.name)})


def device_reads(qpid: int, apid: int | None, stats: Path | None) -> dict[str, int]:
    """What QEMU and the agent fetched from storage so far: the delay device's counters, or /proc/PID/io."""
    if stats is not None:
        counters = delay_stats(stats)
        return {"device": counters.get("read_bytes", 0), "device_requests": counters.get("reads", 0)}
    return {"qemu": read_bytes(qpid), "agent": read_bytes(apid) if apid else 0}


def _io_counter(name: str) -> Callable[[], int | None]:
    """Requests the guest made on vda so far (QEMU's block stats through libvirt); None once it is gone."""
    conn = open_conn()

    def count() -> int | None:
        try:
            rd_req, _, wr_req, _, _ = conn.lookupByName(name).blockStats("vda")
        except libvirt.libvirtError:
            return None
        return rd_req + wr_req

    return count


def sample_agent(apid: int, agent: dict, measuring: bool) -> None:
    st = proc_status(apid)
    agent["peak_rss"] = max(agent["peak_rss"], kib(st, "VmHWM") * 1024)
    agent["peak_anon"] = max(agent["peak_anon"], kib(st, "RssAnon") * 1024)
    c = cpu_seconds(apid)
    if c is not None and measuring:
        if agent["cpu0"] is None:
            agent["cpu0"] = (c, time.monotonic())
        agent["cpu1"] = (c, time.monotonic())


def collect(arm: Arm, res: ArmResult, console: Path) -> None:
    p = plan(arm)
    results = fio_results(console.read_text(errors="replace"))
    if len(results) < p.loops:
        raise RuntimeError(f"{len(results)} fio results on the console, expected {p.loops}")
    res.fio = [results[i]["jobs"][0] for i in p.measured]
    if p.measured[0] > 0:
        res.warmup_fio = results[0]["jobs"][0]
    if arm.scenario.boot:
        res.steady_fio = results[p.measured[-1] + 1]["jobs"][0]


def cleanup(arm: Arm, s: Settings, res: ArmResult, procs: list, device: list) -> None:
    """Stop what the arm started, destroy the domain, wait for the agent to go, unmount, remove the cgroup."""
    for proc in procs:
        stop(proc)
    destroy_domains(PREFIX + arm.name)
    apid = res.agent["pid"] if res.agent else None
    if apid is not None:  # the hook stops the agent on release; give it time
        for _ in range(100):
            if not alive(apid):
                break
            time.sleep(0.1)
        if alive(apid) and agent_pid(PREFIX + arm.name) == apid:
            log(f"{arm.name}: the agent outlived its domain: SIGTERM {apid}")
            os.kill(apid, signal.SIGTERM)
    for proc in device:
        unmount_delay(proc, s.mount)
    CGROUP.remove()


def run_arm(arm: Arm, s: Settings, round_: int,
            on_measuring: Callable[[ArmResult], None] | None = None) -> ArmResult:
    """Run ``arm`` once (round ``round_``); never raises for the arm's own failures."""
    res = ArmResult(arm=arm.name, round=round_)
    adir = s.out / f"r{round_}" / arm.name
    adir.mkdir(parents=True, exist_ok=True)
    console = adir / "console.log"
    console.write_text("")
    procs: list = []
    device: list = []
    reclaimer = None
    t0 = time.monotonic()
    try:
        prepare(arm, s, res, procs, device)
        qpid = boot(arm, s, res, console)
        set_limit(s, res, qpid, console)
        procs.append(start_neighbour(arm, s))
        if arm.scenario.reclaim:
            reclaimer = Reclaimer(CGROUP, s.reclaim_period).start()
        sample(arm, s, res, qpid, console, on_measuring)
        res.cgroup_peak_bytes = int(CGROUP.read("memory.max_usage_in_bytes"))
        collect(arm, res, console)
        res.ok = True
    except Exception as err:  # noqa: BLE001 - one arm's failure must not stop the others
        res.error = f"{type(err).__name__}: {err}"
        log(f"{arm.name}: FAILED {res.error}")
    finally:
        if reclaimer is not None:
            reclaimer.stop()
            res.reclaims = reclaimer.count
        cleanup(arm, s, res, procs, device)
        res.wall_seconds = time.monotonic() - t0
        (adir / "result.json").write_text(json.dumps(asdict(res), indent=1))
    return res


def learn_hotset(device: str, s: Settings) -> str:
    """The hot set a vmcache run of the zoned workload saves, as the domain XML carries it ("" if none).

    Runs zoned-DEVICE-vmcache once (round 0, ``--warmup`` s); when its measured run begins (warm-up
    done, the hot range pinned) the agent is stopped while the domain runs - it saves the hot set into the live XML
    as it stops, as at a host shutdown - and the element is read back from the XML.
    """
    arm = Arm(SCENARIOS["zoned"], device, "vmcache")
    saved: list[str] = []

    def grab(res: ArmResult) -> None:
        apid = res.agent["pid"] if res.agent else 0
        if apid and alive(apid):
            os.kill(apid, signal.SIGTERM)
            wait_for(lambda: not alive(apid), "the agent to save the hot set and exit", timeout=60)
        conn = open_conn()
        try:
            xml = conn.lookupByName(PREFIX + arm.name).XMLDesc(0)
        finally:
            conn.close()
        found = re.search(r"<vmcachehot:hotset\b.*?</vmcachehot:hotset>", xml, re.S)
        saved.append(found.group(0) if found else "")

    res = run_arm(arm, s, 0, on_measuring=grab)
    element = saved[0] if saved else ""
    (s.out / "hotset.xml").write_text(element + "\n")
    log(f"learned hot set: {len(element)} characters"
        + ("" if res.ok else f" (the learning run failed: {res.error})"))
    return element
