"""The agent follows each disk through what operators do (issue 12), with the real libvirtd, QEMU and agent.

Fast destroy/start, external snapshots and block jobs, backing chains,
block devices, two disks on one file, a deleted image, the HTTP server
under a burst. Domains start paused through the installed hook (the real
``vmcache agent``); "guest" writes are HMP ``qemu-io``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

libvirt = pytest.importorskip("libvirt")

from vmcache.host.files import file_stem  # noqa: E402

from tests.live.livelib import MiB, cache_metadata, domain_xml, wait_for  # noqa: E402
from tests.live.test_reliability_live import Env, cleanup, env, running  # noqa: E402,F401 - fixtures

pytestmark = pytest.mark.live

# `vmcache agent` with every QMP command it sends recorded with the domain run (libvirt's domain id)
# that received it, and the run that was current when the agent process started (the one the hook
# started it for).
_RECORDING = """
import json, os, sys
import libvirt, libvirt_qemu
record, name = {record!r}, sys.argv[sys.argv.index("--domain") + 1]
def live_id():
    conn = libvirt.open("qemu:///system")
    try:
        return conn.lookupByName(name).ID()
    except libvirt.libvirtError:
        return -1
    finally:
        conn.close()
started_for = live_id()
_send = libvirt_qemu.qemuMonitorCommand
def send(dom, cmd, flags):
    line = json.dumps({{"agent": os.getpid(), "started_for": started_for, "received_by": live_id(),
                       "cmd": json.loads(cmd)["execute"]}})
    with open(record, "a") as f:
        f.write(line + "\\n")
    return _send(dom, cmd, flags)
libvirt_qemu.qemuMonitorCommand = send
from vmcache.cli import main
sys.exit(main(["agent", *sys.argv[1:]]))
"""


def agents_of(name: str) -> list[int]:
    """Pids of every process running as the agent of domain ``name``."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")[:-1]
        except OSError:
            continue
        if b"agent" in b" ".join(argv) and argv[-2:] == [b"--domain", name.encode()]:
            pids.append(int(entry))
    return pids


def test_fast_destroy_start_twenty_rounds_end_with_one_agent_talking_only_to_its_own_qemu(env: Env, cleanup) -> None:
    name = "vmcache-test-life-race"
    record = env.tmp / "race-qmp.jsonl"
    command = [sys.executable, "-c", _RECORDING.format(record=str(record))]
    cleanup.append(name)
    xml = domain_xml(name, env.disk(name, 32 * MiB), metadata=cache_metadata("16M"))
    with env.config_override(agent_command=command):
        dom = env.live().defineXML(xml)
        try:
            dom.createWithFlags(libvirt.VIR_DOMAIN_START_PAUSED)
            running(env, name)
            for round_ in range(20):
                # Every fourth round the old agent is frozen across destroy/start: still holding its
                # lock mid-cycle when the new run starts, as a slow cleanup would be.
                frozen = agents_of(name) if round_ % 4 == 1 else []
                for pid in frozen:
                    os.kill(pid, signal.SIGSTOP)
                dom.destroy()
                dom.createWithFlags(libvirt.VIR_DOMAIN_START_PAUSED)
                for pid in frozen:
                    os.kill(pid, signal.SIGCONT)
                run_id = dom.ID()

                def settled() -> bool:
                    status, pids = env.status(name), agents_of(name)
                    return (len(pids) == 1 and status is not None and status["pid"] == pids[0]
                            and status.get("domain_id") == run_id and status["state"] == "running")

                try:
                    wait_for(settled, f"round {round_}: one agent, running for domain run {run_id}", timeout=30)
                except AssertionError as err:
                    raise AssertionError(f"{err}: agents {agents_of(name)}, status {env.status(name)}\n"
                                         f"hook log:\n{env.hook_log()[-2000:]}\n"
                                         f"agent log:\n{env.agent_log(name)[-3000:]}") from None
        finally:
            try:
                dom.destroy()
            except libvirt.libvirtError:
                pass
            wait_for(lambda: not agents_of(name), "the last agent to exit", timeout=30)
            dom.undefine()
    sent = [json.loads(line) for line in record.read_text().splitlines()]
    assert sent, "the recorder saw no QMP command"
    stray = [s for s in sent if s["received_by"] not in (s["started_for"], -1)]
    assert not stray, f"{len(stray)} commands reached another run's QEMU: {stray[:5]}"
    assert not list(env.agents.glob(f"{file_stem(name)}*.pid")), "a pidfile was left behind"
    assert "agent.started-after" in env.hook_log()  # the frozen rounds took the successor path

