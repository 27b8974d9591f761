"""Watching one run of an arm: once a second until its guests are done, memory, pins, the agents, the load.

The measured window opens when a guest prints the first measured run's
``VMCACHE-FIO-BEGIN`` and closes at the last one's ``VMCACHE-FIO-END`` (in
any guest's console: the alternating pair's measured runs are in two); the
host's CPU, load and the device reads are taken over it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import libvirt

from bench.e2e_arms import Arm
from bench.e2e_host import (DEVICES, Cgroup, alive, busy_percent, cpu_seconds, cpu_times, delay_stats, kib, loadavg,
                            memory_stat, proc_status, read_bytes)
from bench.e2e_layout import Layout
from bench.e2e_plan import ArmResult, Settings, Vm, guest_seconds, plan
from tests.live.livelib import open_conn, read_status

AGENTS_DIR = Path("/run/vmcache/agents")


def pinned_bytes(domain: str) -> int | None:
    status = read_status(AGENTS_DIR, domain)
    if not status:
        return None
    return sum(d.get("pinned_bytes", 0) for d in status.get("disks", []))


def sample(arm: Arm, s: Settings, res: ArmResult, vms: list[Vm], lay: Layout,
           on_measuring: Callable[[ArmResult], None] | None = None) -> None:
    """Once a second until every guest is done: cgroup memory, pins, the agents' CPU, the host's load.

    Boot scenarios also sample the guest's requests (QEMU's block stats) for the time to steady IOPS;
    ``on_measuring`` runs once when the measured run begins.
    """
    p = plan(arm)
    ios = _io_counter(vms[0].name) if arm.scenario.boot else None
    first, last = p.measured[0] + 1, p.measured[-1] + 1
    agents = [{"pid": vm.agent_pid, "cpu0": None, "cpu1": None, "peak_rss": 0, "peak_anon": 0}
              for vm in vms if vm.agent_pid]
    t_start = time.monotonic()
    slack = 3.0 if arm.scenario.trace else 1.5    # a trace's runs last what its requests take
    deadline = t_start + 60 + guest_seconds(arm, s) * slack + 120
    host0 = None
    stats = s.out / "delaydev.json" if DEVICES[arm.device].delayed else None
    reads0: dict[str, int] = {}
    parent = Cgroup("memory", lay.parent)
    children = [Cgroup("memory", c) for c in lay.children]
    while any(alive(vm.qpid) for vm in vms):
        if time.monotonic() > deadline:
            raise RuntimeError("the guests did not finish in time")
        texts = [vm.console.read_text(errors="replace") for vm in vms]
        text = "\n".join(texts)
        measuring = f"VMCACHE-FIO-BEGIN {first}" in text and f"VMCACHE-FIO-END {last}" not in text
        if measuring and host0 is None:
            if on_measuring is not None:
                on_measuring(res)
            host0, res.load["start"], res.load["start_unix"] = cpu_times(), loadavg(), round(time.time(), 3)
            reads0 = device_reads(vms, stats)
        if not measuring and host0 is not None and "end" not in res.load:
            res.load["end"], res.load["end_unix"] = loadavg(), round(time.time(), 3)
            res.load["host_busy_percent"] = round(busy_percent(host0, cpu_times()), 1)
            reads1 = device_reads(vms, stats)
            res.device_read_bytes = {k: reads1[k] - reads0.get(k, 0) for k in reads1}
        for agent in agents:
            if alive(agent["pid"]):
                sample_agent(agent, measuring)
        stat = memory_stat(parent)
        pins = [pinned_bytes(vm.name) for vm in vms if vm.agent_pid]
        res.cgroup_samples.append({
            "t": round(time.monotonic() - t_start, 1), "measuring": measuring,
            "usage": int(parent.read("memory.usage_in_bytes")), "cache": stat.get("cache", 0),
            "rss": stat.get("rss", 0), "unevictable": stat.get("unevictable", 0),
            "children": {c.name.rsplit("/", 1)[-1]: _usage(c) for c in children},
            "pinned": sum(p or 0 for p in pins) if pins else None,
            "ios": ios() if ios else None,
        })
        if all("VMCACHE-GUEST-DONE" in t for t in texts):
            break
        time.sleep(1)
    for vm, agent in zip((vm for vm in vms if vm.agent_pid), agents):
        c0, c1 = agent["cpu0"], agent["cpu1"]
        res.agents.append({
            "pid": agent["pid"], "domain": vm.name,
            "cpu_percent": 100.0 * (c1[0] - c0[0]) / (c1[1] - c0[1]) if c0 and c1 and c1[1] > c0[1] else None,
            "peak_rss_bytes": agent["peak_rss"], "peak_anon_bytes": agent["peak_anon"],
            "status": read_status(AGENTS_DIR, vm.name)})


def _usage(cg: Cgroup) -> dict[str, int]:
    try:
        stat = memory_stat(cg)
        return {"usage": int(cg.read("memory.usage_in_bytes")), "cache": stat.get("cache", 0),
                "unevictable": stat.get("unevictable", 0)}
    except OSError:
        return {}


def device_reads(vms: list[Vm], stats: Path | None) -> dict[str, int]:
    """What the guests' QEMUs and agents fetched from storage so far: the delay device's counters (every
    file it serves: both images of a pair), or /proc/PID/io on the real disk."""
    if stats is not None:
        counters = delay_stats(stats)
        return {"device": counters.get("read_bytes", 0), "device_requests": counters.get("reads", 0)}
    return {"qemu": sum(read_bytes(vm.qpid) for vm in vms),
            "agent": sum(read_bytes(vm.agent_pid) for vm in vms if vm.agent_pid)}


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


def sample_agent(agent: dict, measuring: bool) -> None:
    st = proc_status(agent["pid"])
    agent["peak_rss"] = max(agent["peak_rss"], kib(st, "VmHWM") * 1024)
    agent["peak_anon"] = max(agent["peak_anon"], kib(st, "RssAnon") * 1024)
    c = cpu_seconds(agent["pid"])
    if c is not None and measuring:
        if agent["cpu0"] is None:
            agent["cpu0"] = (c, time.monotonic())
        agent["cpu1"] = (c, time.monotonic())
