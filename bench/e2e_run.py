"""One arm of the end-to-end bench: boot the guests in their cgroups, run the scenario, collect fio's figures.

Memory: a fresh memory cgroup v1 tree per arm (bench/e2e_layout.py: one
cgroup, or a parent with a child per VM and one for the neighbour). Each
domain is started paused, QEMU moves into its VM's cgroup, then the guests
resume, so every page their I/O brings into the cache is charged there; the
agent and the oracle's locker join the VM's cgroup, the neighbour its own.
Once the guests are up the parent's limit becomes the QEMUs' anonymous
memory plus the cache room (and in ``partition`` mode each child gets its
cap). Device: on the ``ssd`` and ``hdd`` settings the domains open their
images through a delay device mounted for the arm (bench/delaydev.py, a FUSE
passthrough under the page cache), so their misses and the agent's cost the
setting's delay while page-cache hits cost nothing; the neighbours read
their sparse file on the real disk (holes cost no device time anyway).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import shutil
import subprocess
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Iterator

import libvirt

from bench.e2e_arms import AGENT_MODES, MODE_HOST_SETTINGS, SCENARIOS, Arm
from bench.e2e_host import (DEVICES, MIB, Cgroup, Reclaimer, alive, evict, file_size, kib, log, mount_delay, proc_status,
                            run, start_locker, start_range_locker, start_reuse, start_stream, stop, unmount_delay, warm)
from bench.e2e_layout import ROOT, Layout, layout, limits
from bench.e2e_plan import ArmResult, Settings, Vm, busy_runs, hot_range, plan, warmup
from bench.e2e_sample import AGENTS_DIR, sample
from tests.lab import GuestSpec, domain_xml, fio_results
from tests.live.hooklib import HOOK_LOCK
from tests.live.livelib import REPO, destroy_domains, open_conn, wait_for
from tests.live.livelib import qemu_pid as _qemu_pid
from vmcache.errors import VmcacheError
from vmcache.observe.status import file_stem
from vmcache.host.configfile import load_host_config
from vmcache.host.files import lock_holder
from vmcache.host.hotstore import HotStore
from vmcache.settings.metadata import DomainSettings

PREFIX = "vmcache-bench-e2e-"
CGROUP = Cgroup("memory", ROOT)
HOOK = Path("/etc/libvirt/hooks/qemu")
HOOK_PYTHON = "/opt/vmcache/venv/bin/python"
HOST_CONFIG = "/etc/vmcache/vmcache.yaml"
AGENT_LOGS = Path("/var/log/vmcache")


@contextmanager
def hook_lock() -> Iterator[None]:
    """The host-wide hook lock of the live tests (tests/live/hooklib.py), held while an agent arm runs."""
    os.makedirs(os.path.dirname(HOOK_LOCK), exist_ok=True)
    fd = os.open(HOOK_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def ensure_hook(config: str = HOST_CONFIG) -> None:
    """The installed hook, starting agents with host config ``config``, must be the one libvirt runs;
    (re)install it if not (another user's hook, or the pair's config of an earlier arm)."""
    try:
        text = HOOK.read_text()
    except OSError:
        text = ""
    if f"VMCACHE_PYTHON={HOOK_PYTHON}\n" in text and f"VMCACHE_CONFIG={config}\n" in text:
        return
    log(f"{HOOK} is not the installed vmcache hook for {config}: installing it")
    run([str(REPO / "scripts" / "install.sh"), "--hook-only", "--python", HOOK_PYTHON, "--config", config],
        check=False, cwd=REPO)


def host_config(arm: Arm, s: Settings) -> str:
    """The host config the arm's agents run with: the installed one (with ``--host-setting``s), or the pair's,
    or the one of a mode with settings of its own (MODE_HOST_SETTINGS)."""
    if arm.mode in MODE_HOST_SETTINGS:
        return str(s.mode_configs[arm.mode, arm.scenario.vms > 1])
    if arm.scenario.vms > 1 and s.pair_config:
        return str(s.pair_config)
    return str(s.host_config) if s.host_config else HOST_CONFIG


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
    return lock_holder(str(AGENTS_DIR / f"{file_stem(domain)}.pid")) or 0


def agent_log(domain: str) -> Path:
    return AGENT_LOGS / f"agent-{file_stem(domain)}.log"


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


# ---------------------------------------------------------------- steps of an arm

def arm_layout(arm: Arm) -> Layout:
    return layout(arm.scenario.layout, arm.scenario.vms, bool(arm.scenario.neighbour))


def guests(arm: Arm, s: Settings, adir: Path) -> list[Vm]:
    """The arm's VMs: domain names, the image paths they open (through the delay device or not), cgroups."""
    delayed = DEVICES[arm.device].delayed
    lay = arm_layout(arm)
    out = []
    for i, cgroup in enumerate(lay.vms):
        disk = s.image(i)
        suffix = "" if arm.scenario.vms == 1 else f"-{i + 1}"
        out.append(Vm(name=PREFIX + arm.name + suffix, image=s.mount / disk.name if delayed else disk,
                      cgroup=cgroup, console=adir / f"console{suffix}.log",
                      phase=i % 2 if arm.scenario.workload == "alternate" else None))
    return out


def prepare(arm: Arm, s: Settings, res: ArmResult, vms: list[Vm], procs: list, device: list) -> None:
    """Cold images, a fresh cgroup tree, the delay device (its daemon goes to ``device``); the oracle's locker."""
    dev = DEVICES[arm.device]
    if dev.delayed:
        for i in range(len(vms)):
            warm(s.image(i))     # the backing file: a miss costs the delay, not the real disk's latency too
        reads = vms[0].console.parent / "device-reads.log" if s.log_reads else None
        device.append(mount_delay(dev, s.disk.parent, s.mount, s.out / "delaydev.json", reads))
    for vm in vms:
        evict(vm.image)
    lay = arm_layout(arm)
    CGROUP.create()
    for child in lay.children:
        Cgroup("memory", child).create()
    if arm.mode == "oracle":
        cg = Cgroup("memory", vms[0].cgroup)
        trace = s.traces.get(arm.scenario.trace)
        if trace is not None:
            procs.append(locker := start_range_locker(cg, vms[0].image, trace.oracle_ranges, trace.oracle_bytes))
        else:
            procs.append(locker := start_locker(cg, vms[0].image, hot_range(s)))
        res.oracle_locked_bytes = kib(proc_status(locker.pid), "VmLck") * 1024


def domain_of(arm: Arm, s: Settings, vm: Vm) -> str:
    """The domain XML of one of the arm's guests."""
    p = plan(arm)
    agent = arm.mode in AGENT_MODES
    settings = (DomainSettings(budget=s.budget_mib * MIB, model=s.model, minimum=s.min_mib * MIB or None)
                if agent else None)
    alternate = arm.scenario.workload == "alternate"
    trace = s.traces.get(arm.scenario.trace)
    spec = GuestSpec(name=vm.name, disk=str(vm.image), console_log=str(vm.console), guest_dir=s.guest_dir,
                     workload=arm.scenario.workload, qd=arm.scenario.qd, loops=p.loops, memory_mib=s.memory_mib,
                     runtime=s.phase if alternate else s.runtime, warmup=warmup(arm, s),
                     gap=s.gap if arm.scenario.workload == "periodic" else None, settings=settings,
                     phase=vm.phase, initrd=str(trace.initrd) if trace else None)
    xml = domain_xml(spec)
    if arm.mode == "warm":
        if not s.hotset:
            raise RuntimeError("no saved hot set to warm from (learn_hotset did not run or saved none)")
        xml = xml.replace("</metadata>", s.hotset + "</metadata>", 1)
    return xml


def boot(arm: Arm, s: Settings, res: ArmResult, vms: list[Vm]) -> None:
    """Start the domains paused, move each QEMU (and its agent) into its cgroup, then resume them all."""
    agent = arm.mode in AGENT_MODES
    config = host_config(arm, s)
    if agent:
        ensure_hook(config)
    conn = connection()
    try:
        doms = []
        for vm in vms:
            xml = domain_of(arm, s, vm)
            (vm.console.parent / f"{vm.console.stem.replace('console', 'domain')}.xml").write_text(xml)
            vm.console.write_text("")
            if agent:
                vm.agent_log_offset = file_size(agent_log(vm.name))
            doms.append(conn.createXML(xml, libvirt.VIR_DOMAIN_START_PAUSED))
            vm.uuid = doms[-1].UUIDString()
            vm.qpid = _qemu_pid(vm.name)
            Cgroup("memory", vm.cgroup).join(vm.qpid)
            if agent:
                join_agent(vm, config)
        for dom in doms:
            dom.resume()
    finally:
        conn.close()



def join_agent(vm: Vm, config: str) -> None:
    """Find the agent the hook started for ``vm`` and move it into the VM's cgroup before the guest runs."""
    vm.agent_pid = wait_for(lambda: agent_pid(vm.name), "the hook to start the agent", timeout=20, step=0.02)
    Cgroup("memory", vm.cgroup).join(vm.agent_pid)
    line = cmdline(vm.agent_pid)
    if f"--host-config {config} " not in line + " ":
        raise RuntimeError(f"the agent runs with another host config than {config}: {line}")


def set_limits(arm: Arm, s: Settings, res: ArmResult, vms: list[Vm]) -> None:
    """Wait for the guests to be up and QEMU's anonymous memory to settle; then the layout's limits."""
    for vm in vms:
        wait_for(lambda: "VMCACHE-GUEST-READY" in vm.console.read_text(errors="replace") or not alive(vm.qpid),
                 "the guest to come up", timeout=120, step=0.2)
        if not alive(vm.qpid):
            raise RuntimeError(f"QEMU of {vm.name} exited before the guest came up")
    anons = [_settled_anon(vm.qpid) for vm in vms]
    pair = arm.scenario.vms > 1
    res.qemu_anon_bytes = sum(anons)
    res.limits = limits(arm_layout(arm), arm.mode, anons, (s.pair_cache_mib if pair else s.cache_mib) * MIB,
                        s.budget_mib * MIB)
    # the children first: a parent limit under their usage would make the kernel reclaim for nothing
    for name, value in sorted(res.limits.items(), key=lambda kv: -kv[0].count("/")):
        Cgroup("memory", name).write("memory.limit_in_bytes", value)
    res.limit_bytes = res.limits[ROOT]


def _settled_anon(qpid: int) -> int:
    prev = anon = -1
    for _ in range(30):
        anon = kib(proc_status(qpid), "RssAnon") * 1024
        if abs(anon - prev) < 2 * MIB:
            break
        prev = anon
        time.sleep(0.5)
    return anon


def start_neighbour(arm: Arm, s: Settings) -> subprocess.Popen | None:
    where = arm_layout(arm).neighbour
    if where is None:
        return None
    cg = Cgroup("memory", where)
    if arm.scenario.neighbour == "stream":
        return start_stream(cg, s.neighbour_file, s.stream_rate)
    return start_reuse(cg, s.neighbour_file, s.reuse_iops)


def collect(arm: Arm, res: ArmResult, vms: list[Vm]) -> None:
    """The measured fio runs of every guest (an alternating guest prints results for its busy runs only)."""
    p = plan(arm)
    for vm in vms:
        runs = busy_runs(p.loops, vm.phase)
        results = [r["jobs"][0] for r in fio_results(vm.console.read_text(errors="replace"))]
        if len(results) < len(runs):
            raise RuntimeError(f"{vm.name}: {len(results)} fio results on the console, expected {len(runs)}")
        by_run = dict(zip(runs, results))
        res.fio += [by_run[i] for i in p.measured if i in by_run]
        if p.measured[0] > 0 and res.warmup_fio is None:
            res.warmup_fio = results[0]
        if arm.scenario.boot:
            res.steady_fio = by_run[p.measured[-1] + 1]


def cleanup(arm: Arm, s: Settings, res: ArmResult, vms: list[Vm], procs: list, device: list) -> None:
    """Stop what the arm started, destroy the domains, wait for the agents to go, unmount, remove the cgroups."""
    for proc in procs:
        stop(proc)
    destroy_domains(PREFIX + arm.name)
    for vm in vms:
        if not vm.agent_pid:
            continue
        for _ in range(100):  # the hook stops the agent on release; give it time
            if not alive(vm.agent_pid):
                break
            time.sleep(0.1)
        if alive(vm.agent_pid) and agent_pid(vm.name) == vm.agent_pid:
            log(f"{vm.name}: the agent outlived its domain: SIGTERM {vm.agent_pid}")
            os.kill(vm.agent_pid, signal.SIGTERM)
        _copy_tail(agent_log(vm.name), vm.agent_log_offset, vm.console.parent / f"agent-{vm.name}.log")
    forget_hotsets([vm for vm in vms if vm.agent_pid], host_config(arm, s))
    for proc in device:
        unmount_delay(proc, s.mount)
    CGROUP.remove()


def forget_hotsets(vms: list[Vm], config: str) -> None:
    """Remove the hot sets the agents of ``vms`` saved on the host as they stopped (the next run has new uuids)."""
    try:
        hotset_dir = load_host_config(config).hotset_dir
    except VmcacheError as err:
        log(f"the agents' saved hot sets stay: {err}")
        return
    if hotset_dir is None:
        return
    store = HotStore(hotset_dir)
    for vm in vms:
        if vm.uuid:
            try:
                store.remove(vm.uuid)
            except VmcacheError as err:
                log(f"{vm.name}: its saved hot set stays: {err}")


def _copy_tail(src: Path, offset: int, dst: Path) -> None:
    """What ``src`` gained past ``offset`` (the agent's log of this run), to ``dst``."""
    try:
        with open(src, "rb") as f, open(dst, "wb") as out:
            f.seek(offset)
            shutil.copyfileobj(f, out)
    except OSError:
        pass


def run_arm(arm: Arm, s: Settings, round_: int,
            on_measuring: Callable[[ArmResult], None] | None = None) -> ArmResult:
    """Run ``arm`` once (round ``round_``); never raises for the arm's own failures."""
    res = ArmResult(arm=arm.name, round=round_)
    adir = s.out / f"r{round_}" / arm.name
    adir.mkdir(parents=True, exist_ok=True)
    vms = guests(arm, s, adir)
    procs: list = []
    device: list = []
    reclaimer = None
    t0 = time.monotonic()
    try:
        prepare(arm, s, res, vms, procs, device)
        boot(arm, s, res, vms)
        set_limits(arm, s, res, vms)
        procs.append(start_neighbour(arm, s))
        if arm.scenario.reclaim:
            reclaimer = Reclaimer(CGROUP, s.reclaim_period).start()
        sample(arm, s, res, vms, arm_layout(arm), on_measuring)
        res.cgroup_peak_bytes = int(CGROUP.read("memory.max_usage_in_bytes"))
        collect(arm, res, vms)
        res.ok = True
    except Exception as err:  # noqa: BLE001 - one arm's failure must not stop the others
        res.error = f"{type(err).__name__}: {err}"
        log(f"{arm.name}: FAILED {res.error}")
    finally:
        if reclaimer is not None:
            reclaimer.stop()
            res.reclaims = reclaimer.count
        cleanup(arm, s, res, vms, procs, device)
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
        apid = agent_pid(PREFIX + arm.name)
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
