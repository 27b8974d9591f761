"""The two libvirt hosts tests/host/migrate.sh boots, seen from this machine.

Each host is a systemd-nspawn container with its own PID, mount, network and
UTS namespaces; this machine sees its processes (under other pids) and its
files under ``/proc/LEADER/root``. :class:`Host` runs commands in all its
namespaces with nsenter, opens its libvirtd through the UNIX socket under
that root, reads its files, journal and processes. The environment
migrate.sh exports names the hosts: ``VMCACHE_MIGRATE_HOSTS`` is
``NAME:LEADER:ADDRESS,NAME:LEADER:ADDRESS``, ``VMCACHE_MIGRATE_SHARED`` is
``HERE:THERE`` (the shared image directory on this machine, and where both
hosts mount it, each through its own delay device: its own page cache),
``VMCACHE_MIGRATE_MOUNTS`` is ``MOUNT_A,MOUNT_B`` (those two mounts as this
machine reaches them: what is resident there is what each host caches),
``VMCACHE_MIGRATE_PLAIN`` is ``HERE:THERE`` of the directory both bind-mount
for the guest's kernel and the consoles, ``VMCACHE_MIGRATE_DELAY_STATS`` is
``STATS_A,STATS_B`` (each delay device's counters, rewritten every 0.5 s),
``VMCACHE_MIGRATE_READ_LOGS`` is ``LOG_A,LOG_B`` (every read each one served;
only with ``VMCACHE_MIGRATE_LOG_READS=1``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Host", "delay_stats_from_env", "hosts_from_env", "mounts_from_env", "plain_from_env", "read_logs_from_env",
           "shared_from_env"]

PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
LIBVIRT_SOCKET = "/run/libvirt/libvirt-sock"


@dataclass(frozen=True)
class Host:
    """One container host: ``name`` (its hostname), ``leader`` (its PID 1 as this machine sees it)."""

    name: str
    leader: int
    address: str

    # -- commands and files ---------------------------------------------------------------------

    def run(self, *argv: str, check: bool = True, timeout: float = 120.0) -> str:
        """Run ``argv`` in the host's namespaces; its stdout. CalledProcessError (with stderr) if it fails."""
        done = subprocess.run(["nsenter", "-t", str(self.leader), "-a", "--", "env", "-i", f"PATH={PATH}",
                               "HOME=/root", "LANG=C.UTF-8", *argv],
                              capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise subprocess.CalledProcessError(done.returncode, argv, done.stdout, done.stderr)
        return done.stdout

    def path(self, path: str) -> Path:
        """``path`` inside the host, as this machine reaches it."""
        return Path(f"/proc/{self.leader}/root{path}")

    def files(self, *dirs: str) -> set[str]:
        """Every file and directory under ``dirs`` inside the host (paths as the host names them)."""
        found = set()
        for top in dirs:
            root = self.path(top)
            for here, subdirs, names in os.walk(root):
                for name in subdirs + names:
                    found.add(top + str(Path(here, name))[len(str(root)):])
        return found

    # -- libvirt --------------------------------------------------------------------------------

    def uri(self) -> str:
        """A libvirt URI for the host's libvirtd from this machine."""
        return f"qemu+unix:///system?socket={self.path(LIBVIRT_SOCKET)}"

    def connect(self) -> Any:
        import libvirt

        return libvirt.open(self.uri())

    # -- systemd --------------------------------------------------------------------------------

    def unit(self, unit: str) -> dict[str, str]:
        """Properties of ``unit`` (ActiveState, MainPID, ...)."""
        props = "Id,LoadState,ActiveState,SubState,Result,MainPID,NRestarts"
        out = self.run("systemctl", "show", unit, "-p", props)
        return dict(line.partition("=")[::2] for line in out.splitlines())

    def journal(self, unit: str) -> list[tuple[float, str]]:
        """(wall time, message) of every entry of ``unit`` in this boot."""
        out = self.run("journalctl", "-b", "-q", "--no-pager", "-o", "json", "-u", unit)
        entries = []
        for line in out.splitlines():
            entry = json.loads(line)
            message = entry.get("MESSAGE")
            if isinstance(message, list):  # journald's form of a message that is not UTF-8
                message = bytes(message).decode("utf-8", "replace")
            entries.append((int(entry["__REALTIME_TIMESTAMP"]) / 1e6, message or ""))
        return entries

    # -- processes ------------------------------------------------------------------------------

    def pids(self) -> dict[int, int]:
        """The host's processes: {pid inside the host: pid on this machine}."""
        ns = os.readlink(f"/proc/{self.leader}/ns/pid")
        found = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                if os.readlink(f"/proc/{entry.name}/ns/pid") != ns:
                    continue
                status = Path(f"/proc/{entry.name}/status").read_text()
            except OSError:
                continue  # gone meanwhile
            nspid = next(ln for ln in status.splitlines() if ln.startswith("NSpid:")).split()
            found[int(nspid[-1])] = int(entry.name)
        return found

    def locked(self) -> dict[int, int]:
        """{pid on this machine: VmLck bytes} of the host's processes that lock memory."""
        found = {}
        for pid in self.pids().values():
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            for line in status.splitlines():
                if line.startswith("VmLck:") and int(line.split()[1]):
                    found[pid] = int(line.split()[1]) * 1024
        return found

    def scrape(self, url: str) -> str:
        """The text at ``url`` fetched from inside the host's network namespace (its metrics)."""
        code = "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())"
        return subprocess.run(["nsenter", f"--net=/proc/{self.leader}/ns/net", sys.executable, "-c", code, url],
                              capture_output=True, text=True, check=True, timeout=30).stdout


def hosts_from_env() -> tuple[Host, Host] | None:
    """The two hosts migrate.sh booted, or None when it did not (the tests are skipped then)."""
    spec = os.environ.get("VMCACHE_MIGRATE_HOSTS")
    if not spec:
        return None
    a, b = (Host(name, int(leader), address)
            for name, leader, address in (item.split(":") for item in spec.split(",")))
    return a, b


def shared_from_env() -> tuple[Path, str]:
    """(the shared image directory on this machine, its path on both hosts)."""
    here, there = os.environ["VMCACHE_MIGRATE_SHARED"].split(":")
    return Path(here), there


def mounts_from_env() -> tuple[Path, Path]:
    """The shared image directory as host A and as host B see it (their delay devices), on this machine."""
    a, b = os.environ["VMCACHE_MIGRATE_MOUNTS"].split(",")
    return Path(a), Path(b)


def plain_from_env() -> tuple[Path, str]:
    """(the directory of the guest's kernel and the consoles on this machine, its path on both hosts)."""
    here, there = os.environ["VMCACHE_MIGRATE_PLAIN"].split(":")
    return Path(here), there


def delay_stats_from_env() -> tuple[Path, Path]:
    """The counter files of A's and B's delay devices (JSON: reads, read_bytes, ...), on this machine."""
    a, b = os.environ["VMCACHE_MIGRATE_DELAY_STATS"].split(",")
    return Path(a), Path(b)


def read_logs_from_env() -> tuple[Path, Path] | None:
    """The read logs of A's and B's delay devices, or None when migrate.sh was not asked for them."""
    spec = os.environ.get("VMCACHE_MIGRATE_READ_LOGS")
    if not spec:
        return None
    a, b = spec.split(",")
    return Path(a), Path(b)
