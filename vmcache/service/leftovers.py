"""What a killed agent leaves of its own, removed when its domain stops.

An agent removes its files as it stops (vmcache.service.agent). One killed
by SIGKILL or the OOM killer cannot: its pidfile, status file, Prometheus
targets file (Prometheus would go on scraping a dead target and report it
down), run lock, run gate, NBD socket directory and its entries in the
host ledger (reservation and demand: other agents drop a dead agent's only
when they next divide the cap, and with none running they stay) remain. The libvirt hook's
``release`` of the domain (QEMU gone) calls :func:`sweep`, which removes
them - only while no agent of the domain runs: it takes the domain's
pidfile lock first, so no launcher starts one meanwhile, and stops at the
first run lock another process holds (that agent cleans up after itself).
"""

from __future__ import annotations

import os

from ..errors import VmcacheError
from ..host.files import nbd_dir, try_lock
from ..host.ledger import Ledger
from ..host.runlock import RUN_LOCK_DIR
from ..host.warmpool import WarmPool
from ..observe.filesd import targets_path
from ..observe.status import status_path
from ..settings.config import HostConfig
from .detached import pidfile_path

__all__ = ["sweep"]


def _take(path: str) -> int | None:
    """The lock of ``path`` if nobody holds it (None: held, or absent)."""
    if not os.path.exists(path):
        return None
    try:
        fd, _ = try_lock(path, b"")
    except OSError:
        return None
    return fd


def _remove(path: str, removed: list[str]) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return
    except OSError:
        return  # not ours to fight over: the next sweep tries again
    removed.append(path)


def _runs(uuid: str, lock_dir: str) -> list[str]:
    try:
        names = os.listdir(lock_dir)
    except OSError:
        return []
    return sorted(os.path.join(lock_dir, n) for n in names if n.startswith(uuid + "."))


def _sweep_runs(uuid: str, lock_dir: str, removed: list[str]) -> bool:
    """Remove the domain's run locks and gates; False (nothing removed) while an agent holds a run lock."""
    paths = _runs(uuid, lock_dir)
    taken: list[tuple[str, int]] = []
    try:
        for path in (p for p in paths if p.endswith(".lock")):
            fd = _take(path)
            if fd is None:
                return False
            taken.append((path, fd))
        for path in paths:
            if not path.endswith(".lock"):  # gates (and gates being fenced) of runs nobody holds
                _remove(path, removed)
        for path, _ in taken:
            _remove(path, removed)  # unlinked while held: a new claimant opens a fresh file
        return True
    finally:
        for _, fd in taken:
            os.close(fd)


def _sweep_nbd(directory: str, removed: list[str]) -> None:
    """The domain's NBD socket directory: QEMU, which served them, is gone."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        _remove(os.path.join(directory, name), removed)
    try:
        os.rmdir(directory)
    except OSError:
        return
    removed.append(directory)


def _sweep_ledger(config: HostConfig, domain: str, removed: list[str]) -> None:
    """The domain's reservation and demand in the host ledger, and its disks' asks of the warm-up budget (a
    file that cannot be read: left to the agents)."""
    try:
        named = Ledger(config.ledger_path, None).forget(domain)
        asks = WarmPool(config.warmup_path, config.warm_rate, burst=config.interval).forget_owner(domain)
    except VmcacheError:
        return
    removed.extend(f"{path}:{domain}" for path in named)
    removed.extend(f"{config.warmup_path}:{disk}" for disk in asks)


def sweep(config: HostConfig, domain: str, uuid: str | None, *, lock_dir: str = RUN_LOCK_DIR) -> list[str]:
    """Remove what a dead agent of ``domain`` left; the paths removed (none while an agent runs)."""
    removed: list[str] = []
    pidfile = pidfile_path(config.agents_dir, domain)
    held = _take(pidfile)
    if held is None and os.path.exists(pidfile):
        return removed  # an agent runs (or is being started): it owns its files
    try:
        if uuid is not None and not _sweep_runs(uuid, lock_dir, removed):
            return removed
        _remove(status_path(config.agents_dir, domain), removed)
        _remove(str(targets_path(config.targets_dir, domain)), removed)
        _sweep_nbd(nbd_dir(config.runtime_dir, domain), removed)
        _sweep_ledger(config, domain, removed)
        if held is not None:
            _remove(pidfile, removed)
    finally:
        if held is not None:
            os.close(held)
    return removed
