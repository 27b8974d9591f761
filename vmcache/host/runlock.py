"""One agent per run of a domain, host-wide, whatever host config started it.

An agent's pidfile lives in its host config's runtime directory, so two
agents started with two configs (an operator's ``make install`` hook and a
hand-started one, a test's) did not see each other: both tracked the same
disks, and each removed the other's bitmaps as stale at start. The run lock
is keyed by what the agent manages - the domain's uuid and libvirt run id -
in one directory for the whole host: the first agent to ``flock`` it owns
the run; the lock ends with its process (also on ``kill -9``). The holder's
pid is written in the file for the refusal's message.
"""

from __future__ import annotations

import os
from typing import Final

from ..errors import HostError, RunClaimedError
from .files import lock_holder, try_lock

__all__ = ["RUN_LOCK_DIR", "RunLock", "run_holder"]

#: Host-wide (not under a config's runtime_dir): tmpfs, root's, gone at reboot like the runs it names.
RUN_LOCK_DIR: Final = "/run/lock/vmcache"


def _path(directory: str, uuid: str, run: int) -> str:
    return os.path.join(directory, f"{uuid}.{run}.lock")


def run_holder(uuid: str, run: int, directory: str = RUN_LOCK_DIR) -> int | None:
    """The pid of the agent that manages run ``run`` of domain ``uuid`` (0: not written yet); None: none does.

    Raises HostError when the lock file cannot be read.
    """
    return lock_holder(_path(directory, uuid, run))


class RunLock:
    """The lock of one run of a domain; :meth:`claim` once, :meth:`release` at the end."""

    def __init__(self, directory: str = RUN_LOCK_DIR) -> None:
        self.directory = directory
        self.path: str | None = None
        self._fd: int | None = None

    def claim(self, uuid: str, run: int) -> None:
        """Take the lock of run ``run`` of domain ``uuid``.

        Raises RunClaimedError when another process holds it, HostError when
        the lock file cannot be made.
        """
        path = _path(self.directory, uuid, run)
        try:
            os.makedirs(self.directory, mode=0o755, exist_ok=True)
            fd, holder = try_lock(path, f"{os.getpid()}\n".encode())
        except OSError as err:
            raise HostError(f"cannot take the run lock: {err.strerror}", path=path, errno=err.errno) from err
        if fd is None:
            pid = holder.decode("ascii", "replace").strip() or "?"
            raise RunClaimedError(f"run {run} of domain {uuid} is managed by agent pid {pid} already ({path})")
        self._fd, self.path = fd, path

    def release(self) -> None:
        """Remove the lock file and let go (unlinked while held: nobody else owns that name meanwhile)."""
        if self._fd is None:
            return
        assert self.path is not None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None

