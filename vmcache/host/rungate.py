"""The fence between two runs of a domain: no QMP command of an old run's agent reaches a new QEMU.

libvirt finds a domain by uuid whatever its run, so a command that an
agent checked against its run (libvirt's domain id) can still reach the
*next* run's QEMU when a destroy and a start fall between the check and
the send - an agent descheduled or stopped for a moment is enough. Nothing
in libvirt's API names a run, so the agent's commands and the libvirt
hook's ``prepare`` call (made before libvirt starts a new QEMU for the
domain) exclude each other through one *gate* file per run,
``<uuid>.<run>.gate`` beside the run locks:

- the agent makes its gate when it attaches, before it checks its run, and
  holds a shared ``flock`` on it from each command's check to its reply
  (:meth:`RunGate.hold`), the gate's path still naming the file it locked;
- the hook's ``prepare`` for any run of the domain (:func:`fence_runs`)
  renames every gate of the domain away, waits for the exclusive lock -
  the commands in flight to be answered - and removes it. A command after
  that finds no gate and is not sent; the new QEMU does not exist yet.

An agent that holds its gate longer than :data:`FENCE_WAIT` seconds (stopped,
or its command stuck in libvirtd) is killed - a start is never held up for
longer, and it is never failed. The wait is longer than libvirt's own
30 s wait for a domain job, so a command queued in libvirtd behind the
start has been refused by libvirt by then. Imported by the hook: standard
modules and vmcache.host.files and .procs only (tests/unit/test_hook.py).
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Final

from ..errors import HostError, MonitorRunOverError
from .files import names_fd
from .procs import cmdline

__all__ = ["FENCE_WAIT", "GATE_SUFFIX", "Fenced", "RunGate", "fence_runs", "uuid_of"]

#: Longer than libvirt's VIR_JOB_WAIT_TIME (30 s): a command of an old agent waiting for the start's job has failed.
FENCE_WAIT: Final = 35.0
GATE_SUFFIX: Final = ".gate"
_FENCED_SUFFIX: Final = ".fenced"
_UUID = re.compile(rb"<uuid>\s*([0-9a-fA-F-]{32,36})\s*</uuid>")


class RunGate:
    """The gate of one run of a domain, on the agent's side."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.path: str | None = None

    def open(self, uuid: str, run: int) -> None:
        """Make the gate of run ``run`` of domain ``uuid`` (before the run is checked: a later prepare fences it).

        Raises HostError when the file cannot be made.
        """
        path = os.path.join(self.directory, f"{uuid}.{run}{GATE_SUFFIX}")
        try:
            os.makedirs(self.directory, mode=0o755, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            finally:
                os.close(fd)
        except OSError as err:
            raise HostError(f"cannot make the run gate: {err.strerror}", path=path, errno=err.errno) from err
        self.path = path

    @contextmanager
    def hold(self) -> Iterator[None]:
        """Hold the gate (shared) for one command.

        Raises MonitorRunOverError when the run was fenced: a new run is
        being prepared, so this one is over, as if the domain had stopped.
        """
        if self.path is None:
            yield  # not opened (an agent without a run id): the libvirt check alone
            return
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as err:
            raise MonitorRunOverError(f"run fenced: a new run of the domain is starting ({err.strerror})") from err
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # the hook holds it exclusively only to remove it
            if not names_fd(self.path, fd):
                raise MonitorRunOverError("run fenced: a new run of the domain is starting")
            yield
        finally:
            os.close(fd)

    def remove(self) -> None:
        """Remove the gate as the agent exits (a no-op when a prepare removed it, or when never made)."""
        if self.path is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self.path = None


@dataclass(frozen=True)
class Fenced:
    """What :func:`fence_runs` did: the gates removed, how long it waited, the agents it killed."""

    gates: int = 0
    waited: float = 0.0
    killed: tuple[int, ...] = ()


def uuid_of(xml: bytes) -> str | None:
    """The domain's uuid from its XML (the first ``<uuid>``: libvirt writes the domain's before any metadata)."""
    found = _UUID.search(xml)
    return found.group(1).decode("ascii").lower() if found else None


def fence_runs(directory: str, uuid: str, *, wait: float = FENCE_WAIT, clock: Callable[[], float] = time.monotonic,
               sleep: Callable[[float], None] = time.sleep, kill: Callable[[int], None] | None = None) -> Fenced:
    """In the hook's ``prepare``: fence every run of domain ``uuid`` that has a gate. Never raises OSError."""
    try:
        names = [n for n in os.listdir(directory) if n.startswith(uuid + ".") and n.endswith(GATE_SUFFIX)]
    except OSError:
        return Fenced()
    started, killed = clock(), []
    for name in names:
        path = os.path.join(directory, name)
        aside = path[: -len(GATE_SUFFIX)] + _FENCED_SUFFIX
        try:
            os.rename(path, aside)  # no command opens it from now on
            fd = os.open(aside, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue  # its agent removed it as it exited
        try:
            holder = _wait_exclusive(fd, started + wait, clock, sleep)
            if holder is not None:
                killed.append(holder)
                (kill or _kill_agent)(holder)
                _wait_exclusive(fd, clock() + 5.0, clock, sleep)
            try:
                os.unlink(aside)
            except OSError:
                pass
        finally:
            os.close(fd)
    return Fenced(len(names), clock() - started, tuple(killed))


def _wait_exclusive(fd: int, deadline: float, clock: Callable[[], float], sleep: Callable[[float], None]) -> int | None:
    """Take ``fd``'s exclusive lock by ``deadline``: None when taken, else the pid its agent wrote in it (0: none)."""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return None
        except BlockingIOError:
            if clock() >= deadline:
                text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
                return int(text) if text.isdigit() else 0
            sleep(0.005)


def _kill_agent(pid: int) -> None:
    """SIGKILL ``pid`` if it still runs a vmcache agent (a pid written long ago may name another process now)."""
    argv = cmdline(pid) if pid > 0 else None
    if argv is None or "--domain" not in argv or not any("agent" in arg for arg in argv):
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
