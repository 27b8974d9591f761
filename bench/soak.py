"""Soak: three domains with agents, random guest writes, libvirtd restarts and agent kills (``make soak``).

Installs the libvirt hook with a private host config (as the live tests
do, with tests/live/livelib.py, under their host-wide hook lock), starts
three transient TCG domains (paused; "guest" writes are HMP ``qemu-io`` on
the virtio disk) and, for ``--duration`` seconds:

- writes random ranges to random domains every ``--write-every`` seconds;
- every ``--kill-every`` seconds ``kill -9`` one agent at random, then
  restarts libvirtd a few seconds later (its ``reconnect`` hook call is what
  brings a killed agent back where there is no systemd);
- every ``--restart-every`` seconds restarts libvirtd on its own;
- every ``--snapshot-every`` seconds takes an external disk-only snapshot of
  a random domain, writes to it, then commits it back (active blockcommit +
  pivot): the agent must follow both image changes;
- every ``--cycle-every`` seconds destroys a random domain and starts it
  again at once (a new run while the old agent may still be cleaning up);
- samples each agent's RSS and open file descriptors.

At the end it checks, with the domains still running, that QEMU holds no
bitmap, node or export of vmcache's beyond each live agent's own (one
active bitmap, one view node), then destroys the domains and checks that
no agent, pidfile lock, status file, NBD socket or directory, file_sd
target or ledger entry is left. Prints a JSON report; exit 1 when a check
failed. Run as root with libvirtd up (scripts/soak.sh does both).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import libvirt
import yaml

from tests.live.livelib import (

    MiB,

    LiveEnv,

    cache_metadata,

    connect,

    destroy_domains,

    domain_xml,

    nbd_dir,

    restart_libvirtd,

    start_paused,

    stop_agents,

    wait_for,

)

from tests.live.guestlib import guest_write, leftovers, pivot_when_ready

from tests.live.hooklib import installed_hook
from vmcache.host.files import file_stem

DISK = 256 * MiB


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)


def proc_figures(pid: int) -> tuple[int, int] | None:
    try:
        rss = next(int(line.split()[1]) * 1024 for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                   if line.startswith("VmRSS:"))
        return rss, len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, StopIteration):
        return None


def agent_processes(name: str) -> list[int]:
    """Pids of every process running as the agent of domain ``name``."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")[:-1] if entry.isdigit() else []
        except OSError:
            continue
        if argv[-2:] == [b"--domain", name.encode()]:
            pids.append(int(entry))
    return pids


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        tmp = Path(tempfile.mkdtemp(prefix="vmcache-soak-"))
        tmp.chmod(0o755)
        self.env = LiveEnv(None, tmp, tmp / "vmcache.yaml")
        self.env.config.write_text(yaml.safe_dump({
            "runtime_dir": str(self.env.run), "log_dir": str(self.env.logs), "hotset_dir": str(tmp / "hotsets"),
            "interval": "1s",
            "min_free": "512M", "pinned_cap": "256M",
            "agent_command": [sys.executable, "-m", "vmcache", "agent"],
            "model": {"decay": 0.8, "block_size": "1M"},
        }))
        self.prefix = f"vmcache-test-rel-soak-{os.getpid()}-"
        self.names = [f"{self.prefix}{i}" for i in range(3)]
        self.hook = ExitStack()
        self.samples: dict[str, list[tuple[float, int, int, int]]] = {n: [] for n in self.names}
        self.events = {"writes": 0, "written_bytes": 0, "agent_kills": 0, "libvirtd_restarts": 0,
                       "agent_restarts_seen": 0, "snapshots_committed": 0, "fast_restarts": 0}
        self.xml: dict[str, str] = {}
        self.failures: list[str] = []

    # -- set-up and tear-down ---------------------------------------------------------------

    def install(self) -> None:
        """The hook for our host config, held (with the live tests' hook lock) until cleanup()."""
        self.hook.enter_context(installed_hook(self.env.config))
        self.env.conn = connect(timeout=60)

    def start_domains(self) -> None:
        for name in self.names:
            xml = domain_xml(name, self.env.disk(name, DISK), metadata=cache_metadata("64M"))
            self.xml[name] = xml
            start_paused(self.env.conn, xml)
        for name in self.names:
            wait_for(lambda n=name: self.env.agent_pid(n), f"agent of {name}")

    def cleanup(self) -> None:
        destroy_domains(self.prefix)
        stop_agents(self.env.agents, grace=20)  # ours, and any our hook started for other domains
        self.hook.close()
        if not self.args.keep:
            shutil.rmtree(self.env.tmp, ignore_errors=True)

    # -- helpers ----------------------------------------------------------------------------

    def dom(self, name: str) -> Any:
        try:
            return self.env.conn.lookupByName(name)
        except libvirt.libvirtError:
            self.env.conn = connect(timeout=60)
            return self.env.conn.lookupByName(name)

    def write(self) -> None:
        name = self.rng.choice(self.names)
        hot = self.rng.random() < 0.7
        offset = (self.rng.randrange(0, 16) if hot else self.rng.randrange(0, DISK // MiB - 4)) * MiB
        length = self.rng.choice([64 * 1024, 256 * 1024, MiB, 4 * MiB])
        try:
            guest_write(self.dom(name), offset, length, pattern=0x5A)
            self.events["writes"] += 1
            self.events["written_bytes"] += length
        except libvirt.libvirtError:
            self.env.conn = connect(timeout=60)

    def restart_libvirtd(self) -> None:
        try:
            self.env.conn.close()
        except libvirt.libvirtError:
            pass
        restart_libvirtd()
        self.env.conn = connect(timeout=60)
        self.events["libvirtd_restarts"] += 1

    def snapshot_and_commit(self) -> None:
        """An external snapshot of a random domain, writes on it, then an active commit + pivot back."""
        name = self.rng.choice(self.names)
        dom = self.dom(name)
        overlay = self.env.tmp / f"{file_stem(name)}-snap{self.events['snapshots_committed']}.qcow2"
        log(f"snapshot + blockcommit {name}")
        try:
            dom.snapshotCreateXML(
                f"<domainsnapshot><disks><disk name='vda' snapshot='external'><driver type='qcow2'/>"
                f"<source file='{overlay}'/></disk></disks></domainsnapshot>",
                libvirt.VIR_DOMAIN_SNAPSHOT_CREATE_DISK_ONLY | libvirt.VIR_DOMAIN_SNAPSHOT_CREATE_NO_METADATA)
            for _ in range(4):
                guest_write(dom, self.rng.randrange(0, 16) * MiB, MiB, pattern=0x3C)
                time.sleep(0.5)
            dom.blockCommit("vda", None, None, 0, libvirt.VIR_DOMAIN_BLOCK_COMMIT_ACTIVE)
            pivot_when_ready(dom, "vda")
            self.events["snapshots_committed"] += 1
        except (libvirt.libvirtError, AssertionError) as err:
            self.failures.append(f"{name}: snapshot/commit failed: {err}")
            try:  # a job left running would fail every later snapshot of this domain too
                dom.blockJobAbort("vda", 0)
            except libvirt.libvirtError:
                pass

    def fast_restart(self) -> None:
        """virsh destroy; virsh start of a random domain, without waiting for its agent."""
        name = self.rng.choice(self.names)
        log(f"destroy + start {name}")
        try:
            self.dom(name).destroy()
            start_paused(self.env.conn, self.xml[name])
            self.events["fast_restarts"] += 1
        except libvirt.libvirtError as err:
            self.failures.append(f"{name}: destroy/start failed: {err}")

    def sample(self, now: float) -> None:
        for name in self.names:
            pid = self.env.agent_pid(name)
            figures = proc_figures(pid) if pid else None
            if figures:
                self.samples[name].append((now, pid, *figures))

    # -- the run ----------------------------------------------------------------------------

    def run(self) -> dict:
        a = self.args
        self.install()
        self.start_domains()
        started = time.monotonic()
        next_kill, next_restart, next_sample = a.kill_every, a.restart_every, 0.0
        next_snapshot, next_cycle = a.snapshot_every, a.cycle_every
        pending_restart: float | None = None
        while (now := time.monotonic() - started) < a.duration:
            self.write()
            if now >= next_sample:
                self.sample(now)
                next_sample += a.sample_every
            if now >= next_kill:
                victim = self.rng.choice(self.names)
                pid = self.env.agent_pid(victim)
                if pid:
                    log(f"kill -9 agent of {victim} ({pid})")
                    os.kill(pid, signal.SIGKILL)
                    self.events["agent_kills"] += 1
                pending_restart = now + 5
                next_kill += a.kill_every
            if now >= next_snapshot:
                self.snapshot_and_commit()
                next_snapshot += a.snapshot_every
            if now >= next_cycle:
                self.fast_restart()
                next_cycle += a.cycle_every
            if (pending_restart is not None and now >= pending_restart) or now >= next_restart:
                log("restart libvirtd")
                self.restart_libvirtd()
                if now >= next_restart:
                    next_restart += a.restart_every
                pending_restart = None
            time.sleep(a.write_every)
        # Everything back: each domain has exactly one agent, cycling.
        for name in self.names:
            try:
                wait_for(lambda n=name: self.env.agent_pid(n) and len(agent_processes(n)) == 1,
                         f"one agent of {name}", 60)
            except AssertionError:
                self.failures.append(f"{name}: agents at the end: {agent_processes(name)}")
        time.sleep(3)
        self.sample(time.monotonic() - started)
        report = self.report()
        return report

    def report(self) -> dict:
        qemu = {}
        for name in self.names:
            left = leftovers(self.dom(name))
            qemu[name] = left
            if len(left["bitmaps"]) > 2 or left["exports"] or len(left["nodes"]) > 1:
                self.failures.append(f"{name}: leftovers in QEMU while running: {left}")
        agents = {}
        for name, samples in self.samples.items():
            pids = sorted({s[1] for s in samples}, key=lambda p: next(s[0] for s in samples if s[1] == p))
            self.events["agent_restarts_seen"] += max(0, len(pids) - 1)
            longest = max(pids, key=lambda p: sum(1 for s in samples if s[1] == p)) if pids else None
            life = [s for s in samples if s[1] == longest]
            # Flat RSS is judged on a life long enough to have warmed up (60 s in, to its end).
            warm = [s for s in life if s[0] - life[0][0] >= 60] if life and life[-1][0] - life[0][0] >= 180 else []
            agents[name] = {
                "pids": len(pids),
                "longest_life_seconds": round(life[-1][0] - life[0][0]) if life else 0,
                "rss_mib_start": round(life[0][2] / MiB, 1) if life else None,
                "rss_mib_after_warmup": round(warm[0][2] / MiB, 1) if warm else None,
                "rss_mib_end": round(life[-1][2] / MiB, 1) if life else None,
                "rss_mib_max": round(max(s[2] for s in life) / MiB, 1) if life else None,
                "fds_start": life[0][3] if life else None,
                "fds_after_warmup": warm[0][3] if warm else None,
                "fds_end": life[-1][3] if life else None,
                "fds_max": max(s[3] for s in life) if life else None,
            }
            if warm and life[-1][2] - warm[0][2] > 16 * MiB:
                self.failures.append(f"{name}: RSS grew {(life[-1][2] - warm[0][2]) / MiB:.1f} MiB after warm-up")
            if warm and life[-1][3] > warm[0][3] + 2:
                self.failures.append(f"{name}: fds grew from {warm[0][3]} to {life[-1][3]}")
        # Stop everything; nothing may be left.
        for name in self.names:
            self.dom(name).destroy()
        for name in self.names:
            try:
                wait_for(lambda n=name: self.env.agent_pid(n) is None, f"agent of {name} to exit", 20)
            except AssertionError:
                self.failures.append(f"{name}: agent did not exit after destroy")
        run = self.env.run
        mine = {file_stem(n) for n in self.names} | {nbd_dir(run, n).name for n in self.names}
        left_files = sorted(rel for p in run.rglob("*")
                            if (p.is_socket() or p.suffix in (".json", ".pid") and p.name != "ledger.json"
                                or p.is_dir() and p.parent.name == "nbd")
                            and any(m in (rel := str(p.relative_to(run))) for m in mine))
        ledger = json.loads((run / "ledger.json").read_text()) if (run / "ledger.json").exists() else {}
        if left_files:
            self.failures.append(f"files left: {left_files}")
        if any(name in json.dumps(ledger) for name in self.names):
            self.failures.append(f"ledger entries left: {ledger}")
        errors = sum(p.read_text(errors="replace").count("Traceback") for p in self.env.logs.glob("agent-*.log"))
        if errors:
            self.failures.append(f"{errors} tracebacks in agent logs")
        return {
            "duration_seconds": self.args.duration, "events": self.events, "agents": agents,
            "qemu_at_end": qemu, "files_left": left_files,
            "tracebacks": errors, "failures": self.failures, "logs": str(self.env.logs) if self.args.keep else None,
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600)
    parser.add_argument("--write-every", type=float, default=0.25)
    parser.add_argument("--kill-every", type=float, default=90)
    parser.add_argument("--restart-every", type=float, default=130)
    parser.add_argument("--snapshot-every", type=float, default=75)
    parser.add_argument("--cycle-every", type=float, default=110)
    parser.add_argument("--sample-every", type=float, default=10)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (logs)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("soak: needs root", file=sys.stderr)
        return 2
    libvirt.registerErrorHandler(lambda _c, _e: None, None)
    soak = Soak(args)
    report: dict = {}
    try:
        report = soak.run()
    except Exception as err:  # noqa: BLE001 - report what broke, clean up, fail
        soak.failures.append(f"soak aborted: {err!r}")
        report = {"failures": soak.failures, "events": soak.events}
    finally:
        soak.cleanup()
    print(json.dumps(report, indent=2))
    return 1 if report.get("failures") else 0


if __name__ == "__main__":
    sys.exit(main())
