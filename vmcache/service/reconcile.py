"""Reconcile: an agent for every running domain vmcache should manage, and none for the others.

The libvirt hook starts and stops agents as domains start and stop. It
cannot see what changes while they run, and it starts nothing while the
host config is broken. Reconcile looks at every running domain instead -
its XML (metadata, Nova's metadata) against the host rules - and at the
agents there are, and:

- starts an agent for a running domain vmcache should manage and no agent
  manages: a host rule added since it started, a domain started while the
  config was broken, vmcache installed with domains running, an agent
  systemd gave up on;
- stops the agent of a running domain vmcache should no longer manage (a
  rule removed or narrowed).

It runs as ``vmcache reconcile`` (commands/reconcile.py): by hand, by
``systemctl reload vmcache`` (the unit's ExecReload, and ExecStart at
boot), by the Debian package's postinst, and when a running agent notices
a changed config (:class:`ReconcileRequest`, with ``--if-changed``: once
per version of the file, however many agents noticed it). Never from the
hook: it calls libvirt. Runs are serialized by a lock in the runtime dir.

An agent is found by its run lock (vmcache.host.runlock): host-wide, held
exactly as long as the agent, whatever config or launcher started it.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, HostError, VmcacheError
from ..host.configfile import config_identity
from ..host.files import exclusive, write_atomic
from ..host.runlock import RUN_LOCK_DIR, run_holder
from ..host.virtdomain import active_domains
from ..logfmt import event
from ..settings.config import DEFAULT_PATH, HostConfig
from ..settings.metadata import parse_domain
from ..settings.rules import OptIn, Rule, decide
from .launchresult import Launcher, LaunchResult
from .systemdunit import SYSTEMD_RUN_DIR

__all__ = ["RunningDomain", "Plan", "Outcome", "ReconcileRequest", "plan", "survey", "reconcile", "reconcile_once",
           "UNIT"]

log = logging.getLogger("vmcache.service.reconcile")

#: The unit whose ExecStart and ExecReload run ``vmcache reconcile`` (hooks/vmcache.service).
UNIT = "vmcache.service"
_MARK = "reconciled.json"


@dataclass(frozen=True)
class RunningDomain:
    """A running domain as reconcile sees it: whether vmcache should manage it, and its agent.

    ``agent``: the pid of the agent that holds the run's lock (0: not
    written yet), None when no agent manages the run.
    """

    name: str
    uuid: str
    run: int | None
    opt_in: OptIn
    agent: int | None = None


@dataclass(frozen=True)
class Plan:
    """What reconcile does: agents to ``start`` and to ``stop``; ``keep``: managed and with an agent."""

    start: tuple[RunningDomain, ...] = ()
    stop: tuple[RunningDomain, ...] = ()
    keep: tuple[RunningDomain, ...] = ()


@dataclass(frozen=True)
class Outcome:
    """A reconcile's plan, what the launcher said for each domain, and what failed (one line each)."""

    plan: Plan
    results: tuple[tuple[RunningDomain, LaunchResult], ...] = ()
    errors: tuple[str, ...] = ()
    skipped: bool = False  # --if-changed, and this version of the config was reconciled already


def plan(domains: Sequence[RunningDomain]) -> Plan:
    """Start an agent where one should run and none does, stop it where none should (pure)."""
    return Plan(start=tuple(d for d in domains if d.opt_in.enabled and d.agent is None),
                stop=tuple(d for d in domains if not d.opt_in.enabled and d.agent is not None),
                keep=tuple(d for d in domains if d.opt_in.enabled and d.agent is not None))


def survey(conn: Any, rules: Sequence[Rule], *, lock_dir: str = RUN_LOCK_DIR,
           domains: Callable[[Any], list[tuple[str, str]]] = active_domains) -> list[RunningDomain]:
    """Every running domain of ``conn``, decided by its XML and ``rules``, with its agent.

    A domain whose XML or metadata cannot be used is listed as not managed,
    with why. Raises DomainError when libvirt cannot list the domains.
    """
    found = []
    for name, xml in domains(conn):
        try:
            info = parse_domain(xml)
        except ConfigError as err:
            found.append(RunningDomain(name, "", None, OptIn(None, f"unusable XML or metadata: {err}")))
            continue
        if info.id is None:
            continue  # stopped between the listing and the read of its XML
        try:
            agent = run_holder(info.uuid, info.id, lock_dir)
        except HostError as err:
            found.append(RunningDomain(info.name, info.uuid, info.id, OptIn(None, f"run lock: {err}")))
            continue
        found.append(RunningDomain(info.name, info.uuid, info.id, decide(info, rules), agent))
    return found


def reconcile(conn: Any, config: HostConfig, launcher: Launcher, *, lock_dir: str = RUN_LOCK_DIR,
              dry_run: bool = False) -> Outcome:
    """Survey the running domains and start and stop agents to match. Raises DomainError (libvirt)."""
    todo = plan(survey(conn, config.rules, lock_dir=lock_dir))
    if dry_run:
        return Outcome(todo)
    results: list[tuple[RunningDomain, LaunchResult]] = []
    errors: list[str] = []
    for domain, act in [(d, "start") for d in todo.start] + [(d, "stop") for d in todo.stop]:
        try:
            result = launcher.start(domain.name, domain.run) if act == "start" else launcher.stop(domain.name)
        except VmcacheError as err:
            errors.append(f"{domain.name}: cannot {act} its agent: {err}")
            log.error(event("reconcile.failed", domain=domain.name, action=act, error=err))
            continue
        results.append((domain, result))
        log.info(event("reconcile." + act, domain=domain.name, why=domain.opt_in.why, result=str(result)))
    return Outcome(todo, tuple(results), tuple(errors))


@contextmanager
def _serialized(runtime_dir: str) -> Iterator[None]:
    """One reconcile at a time on this host config's runtime dir (waits for the one running)."""
    with exclusive(os.path.join(runtime_dir, "reconcile"), "reconcile"):
        yield


def _reconciled(runtime_dir: str) -> object:
    try:
        with open(os.path.join(runtime_dir, _MARK), encoding="utf-8") as f:
            return json.load(f).get("config")
    except (OSError, ValueError, AttributeError):
        return None


def reconcile_once(conn_of: Callable[[], Any], config: HostConfig, config_path: str, launcher: Launcher, *,
                   if_changed: bool = False, dry_run: bool = False, lock_dir: str = RUN_LOCK_DIR) -> Outcome:
    """:func:`reconcile` under the runtime dir's lock; ``if_changed``: not again for a config already reconciled.

    ``conn_of`` opens the libvirt connection (only when there is work). Raises DomainError, HostError.
    """
    with _serialized(config.runtime_dir):
        version = config_identity(config_path)
        if if_changed and version is not None and _reconciled(config.runtime_dir) == version:
            return Outcome(Plan(), skipped=True)
        outcome = reconcile(conn_of(), config, launcher, lock_dir=lock_dir, dry_run=dry_run)
        if not dry_run and not outcome.errors:
            write_atomic(os.path.join(config.runtime_dir, _MARK), json.dumps({"config": version}), fsync=False,
                         what="reconcile mark")
        return outcome


class ReconcileRequest:
    """How a running agent asks for a reconcile (:meth:`__call__`): never blocks, never raises.

    With systemd and the default config: ``systemctl --no-block reload-or-restart vmcache.service``
    (the reconcile runs in that unit, not in the agent's, which may be stopping). Otherwise, or when
    that fails: ``vmcache reconcile --if-changed`` as a process of its own session, its output
    appended to ``<log_dir>/reconcile.log``.
    """

    def __init__(self, config: HostConfig, config_path: str, uri: str, *, systemd_dir: str = SYSTEMD_RUN_DIR,
                 python: str = sys.executable, popen: Callable[..., Any] = subprocess.Popen,
                 logger: logging.Logger = log) -> None:
        self._config = config
        self._config_path = os.path.abspath(config_path)
        self._uri = uri
        self._systemd = os.path.isdir(systemd_dir) and self._config_path == DEFAULT_PATH
        self._python = python
        self._popen = popen
        self._log = logger
        self._child: Any = None

    def __call__(self) -> None:
        if self._child is not None and self._child.poll() is None:
            return  # the one asked for last is still running
        self._child = None
        if self._systemd and self._systemctl():
            return
        argv = [self._python, "-m", "vmcache", "reconcile", "--if-changed", "--quiet",
                "--host-config", self._config_path, "--uri", self._uri]
        try:
            os.makedirs(self._config.log_dir, mode=0o755, exist_ok=True)
            with open(os.path.join(self._config.log_dir, "reconcile.log"), "ab") as out:
                self._child = self._popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, cwd="/",
                                          start_new_session=True, close_fds=True)
        except OSError as err:
            self._log.warning(event("reconcile.request_failed", error=err))
            return
        self._log.info(event("reconcile.requested", pid=self._child.pid))

    def _systemctl(self) -> bool:
        try:
            done = subprocess.run(["systemctl", "--no-block", "reload-or-restart", UNIT], stdin=subprocess.DEVNULL,
                                  capture_output=True, timeout=10, check=False)
        except (OSError, subprocess.TimeoutExpired) as err:
            self._log.warning(event("reconcile.request_failed", unit=UNIT, error=err))
            return False
        if done.returncode != 0:
            self._log.warning(event("reconcile.request_failed", unit=UNIT,
                                    error=done.stderr.decode("utf-8", "replace").strip()[:200]))
            return False
        self._log.info(event("reconcile.requested", unit=UNIT))
        return True

