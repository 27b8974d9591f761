"""The libvirt qemu hook: decide from argv and the domain XML, start or stop the agent.

libvirt runs ``/etc/libvirt/hooks/qemu DOMAIN OP SUBOP EXTRA`` with the
domain XML on stdin (hooks/qemu runs ``python -m vmcache.service.hook``):

- ``started``, ``reconnect``, ``attach`` of a domain vmcache manages - its
  metadata says enabled, or it has none and a host rule opts it in
  (:func:`vmcache.settings.rules.decide`): make sure its agent runs
  (:mod:`vmcache.service.launcher`); with a broken host config nothing
  starts (which rules apply is unknown), and ``vmcache reconcile`` mends
  that once it is fixed;
- ``stopped``, ``release``: stop its agent (a no-op when none runs);
- ``migrate``, ``restore``: XML filters; the XML is written back unchanged;
- ``prepare`` (before libvirt starts a new QEMU for any domain): fence the
  domain's earlier runs, so that no command of their agents reaches the new
  QEMU (:func:`vmcache.host.rungate.fence_runs`; waits only while such an
  agent has a command in flight);
- anything else: nothing.

The hook never calls libvirt (libvirtd waits for it: deadlock), returns
at once, and exits 0 whatever happens - vmcache must never make a domain
fail to start - logging why it did nothing to syslog (``/dev/log``) or
``<log_dir>/hook.log``. It imports no numpy, libvirt or
prometheus_client: tests/unit/test_hook.py checks that.

libvirtd waits for every call, so the hook does the cheapest checks first
(docs/install.md, "The hook"): the operation alone settles filters, stops
and operations vmcache ignores; the host config comes from the JSON cache
:func:`vmcache.host.configfile.load_host_config` keeps (no PyYAML while the file is
unchanged); on a host without rules a domain XML that does not contain
vmcache's namespace URI (every domain with vmcache metadata has it) is
ignored before any XML parser is loaded; the XML parser (defusedxml) and
the launcher are imported only when needed.
"""

from __future__ import annotations

import enum
import logging
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..host.configfile import CACHE_DIR
from ..settings.config import DEFAULT_PATH
from ..errors import ConfigError, VmcacheError
from ..logfmt import event

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from typing import BinaryIO

    from ..settings.config import HostConfig
    from ..settings.rules import Rule
    from .launchresult import Launcher

__all__ = ["Action", "Decision", "run", "main", "START_OPS", "STOP_OPS", "FILTER_OPS", "FENCE_OPS"]

START_OPS = frozenset({"started", "reconnect", "attach"})
STOP_OPS = frozenset({"stopped", "release"})
FILTER_OPS = frozenset({"migrate", "restore"})
FENCE_OPS = frozenset({"prepare"})
SYSLOG_SOCKET = "/dev/log"
#: vmcache.settings.metadata.NAMESPACE, spelled out so that the fast path imports no XML code
#: (tests/unit/test_hook.py checks they are equal).
_NAMESPACE = b"urn:x-vmcache:domain:1"

log = logging.getLogger("vmcache.service.hook")


class Action(enum.Enum):
    START = "start"
    STOP = "stop"
    FILTER = "filter"
    FENCE = "fence"
    IGNORE = "ignore"


@dataclass(frozen=True)
class Decision:
    """What the hook does for one call, and why (logged)."""

    action: Action
    domain: str
    op: str
    reason: str
    domain_id: int | None = None  # the run to start the agent for (the XML's <domain id=...>)


def _decide_by_op(argv: Sequence[str]) -> Decision | None:
    """The decision when the operation alone settles it; None for START_OPS (the XML decides)."""
    if len(argv) < 2:
        return Decision(Action.IGNORE, argv[0] if argv else "", "", "usage: DOMAIN OP SUBOP EXTRA")
    domain, op = argv[0], argv[1]
    if op in FILTER_OPS:
        return Decision(Action.FILTER, domain, op, "XML filter: written back unchanged")
    if op in STOP_OPS:
        return Decision(Action.STOP, domain, op, "domain stopped")
    if op in FENCE_OPS:
        return Decision(Action.FENCE, domain, op, "a new run starts: fence the earlier runs' agents")
    if op not in START_OPS:
        return Decision(Action.IGNORE, domain, op, "not an operation vmcache acts on")
    return None


def _decide_by_xml(domain: str, op: str, xml: bytes | str, rules: Sequence[Rule]) -> Decision:
    from ..settings.metadata import parse_domain  # defusedxml and xml.etree: only for XML that may opt in
    from ..settings.rules import decide

    try:
        info = parse_domain(xml)
    except ConfigError as err:
        return Decision(Action.IGNORE, domain, op, f"unusable XML or metadata: {err}")
    if info.name != domain:
        return Decision(Action.IGNORE, domain, op, f"XML is for domain {info.name!r}")
    opt_in = decide(info, rules)
    if opt_in.enabled:
        return Decision(Action.START, domain, op, f"opted in by {opt_in.why}", domain_id=info.id)
    if opt_in.settings is None:
        return Decision(Action.IGNORE, domain, op, opt_in.why)
    if info.settings is not None:
        return Decision(Action.IGNORE, domain, op, "vmcache metadata says enabled=no")
    return Decision(Action.IGNORE, domain, op, f"kept out by {opt_in.why}")


def _mentions_namespace(xml: bytes | str) -> bool:
    """False when vmcache's namespace URI is nowhere in ``xml``: then no element of it can opt in.

    libvirt writes the URI of a metadata element literally, so this never
    ignores a domain libvirt reports as opted in; it only spares the parser.
    """
    return _NAMESPACE in (xml if isinstance(xml, bytes) else xml.encode("utf-8", "surrogatepass"))


class _SyslogHandler(logging.Handler):
    """Datagrams to a syslog socket as logging.handlers.SysLogHandler(facility=LOG_DAEMON) sends
    them, without importing logging.handlers (pickle, queue, struct, ...: milliseconds per call)."""

    _FACILITY_DAEMON = 3
    _SEVERITY = {"CRITICAL": 2, "ERROR": 3, "WARNING": 4, "INFO": 6, "DEBUG": 7}

    def __init__(self, address: str) -> None:
        """Connect to the socket at ``address`` (datagram, else stream); OSError if neither works."""
        import socket

        super().__init__()
        for kind in (socket.SOCK_DGRAM, socket.SOCK_STREAM):
            self.socket = socket.socket(socket.AF_UNIX, kind | socket.SOCK_CLOEXEC)
            try:
                self.socket.connect(address)
                return
            except OSError:
                self.socket.close()
                if kind == socket.SOCK_STREAM:
                    raise

    def emit(self, record: logging.LogRecord) -> None:
        try:
            priority = self._FACILITY_DAEMON << 3 | self._SEVERITY.get(record.levelname, 4)
            self.socket.sendall(f"<{priority}>{self.format(record)}\000".encode("utf-8", "replace"))
        except Exception:  # noqa: BLE001 - logging's contract: report through handleError, never raise
            self.handleError(record)

    def close(self) -> None:
        self.socket.close()
        super().close()


def _setup_logging(log_dir: str, *, syslog: str = SYSLOG_SOCKET) -> None:
    """Log to syslog when its socket exists, else append to ``<log_dir>/hook.log``; never raise."""
    handler: logging.Handler
    try:
        if os.path.exists(syslog):
            handler = _SyslogHandler(syslog)
            handler.setFormatter(logging.Formatter(f"vmcache-hook[{os.getpid()}]: %(message)s"))
        else:
            os.makedirs(log_dir, mode=0o755, exist_ok=True)
            handler = logging.FileHandler(os.path.join(log_dir, "hook.log"), encoding="utf-8")
            handler.setFormatter(
                logging.Formatter(f"%(asctime)s vmcache-hook[{os.getpid()}] %(levelname)s %(message)s"))
    except OSError:
        handler = logging.NullHandler()
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def _parse_args(argv: Sequence[str]) -> tuple[str, list[str]]:
    args = list(argv)
    config_path = DEFAULT_PATH
    if len(args) >= 2 and args[0] == "--config":
        config_path, args = args[1], args[2:]
    return config_path, args


def _host_config(config_path: str, cache_dir: str | None) -> tuple[HostConfig, ConfigError | None]:
    """The host config (the defaults, with its directories where they can be read, and why, when it is not valid)."""
    from ..host.configfile import load_or_salvage

    return load_or_salvage(config_path, check_model=False, cache_dir=cache_dir)


def run(
    args: Sequence[str],
    stdin: BinaryIO,
    stdout: BinaryIO,
    *,
    config_path: str = DEFAULT_PATH,
    launcher_for: Callable[..., Launcher] | None = None,
    setup_logging: Callable[[str], None] | None = _setup_logging,
    cache_dir: str | None = CACHE_DIR,
    sweep: Callable[[HostConfig, str, bytes], None] | None = None,
) -> Decision:
    """One hook call: echo filters, decide, act; returns the decision. Raises nothing vmcache-made.

    ``launcher_for`` defaults to :func:`vmcache.service.launcher.make_launcher`;
    ``cache_dir`` is where the validated host config is cached (None: no cache);
    ``sweep`` removes a killed agent's files at ``release`` (default :func:`_sweep`).
    """
    data = stdin.read()
    op = args[1] if len(args) > 1 else ""
    if op in FILTER_OPS:
        stdout.write(data)
        stdout.flush()
    decision = _decide_by_op(args)
    if decision is not None and decision.action is Action.FENCE:
        _fence(decision.domain, data, lambda: setup_logging(_host_config(config_path, cache_dir)[0].log_dir)
               if setup_logging is not None else None)
        return decision
    if decision is not None and decision.action is not Action.STOP:
        return decision  # a filter, or nothing vmcache acts on: nothing to do or log
    config, config_error = _host_config(config_path, cache_dir)
    if setup_logging is not None:
        setup_logging(config.log_dir)
    if decision is None:
        if config_error is None and (config.rules or _mentions_namespace(data)):
            decision = _decide_by_xml(args[0], op, data, config.rules)
        else:
            decision = Decision(Action.IGNORE, args[0], op, "no vmcache metadata")
    fields = {"domain": decision.domain, "op": decision.op}
    if config_error is not None:
        if decision.action is not Action.STOP:  # which rules apply is not known: nothing starts (reconcile mends it)
            log.error(event("hook.ignore", **fields, reason=f"host config: {config_error}"))
            return Decision(Action.IGNORE, decision.domain, decision.op, f"host config: {config_error}")
        log.warning(event("hook.config_error", **fields, error=str(config_error), using="defaults"))
    if decision.action is Action.START or decision.action is Action.STOP:
        _launch(decision, config, config_path, launcher_for)
        if decision.op == "release":
            (sweep or _sweep)(config, decision.domain, data)
    elif decision.action is Action.IGNORE and decision.op in START_OPS:
        log.info(event("hook.ignore", **fields, reason=decision.reason))
    return decision


def _launch(decision: Decision, config: HostConfig, config_path: str,
            launcher_for: Callable[..., Launcher] | None) -> None:
    """Start or stop the domain's agent as decided, and log what came of it; a failure is logged, not raised."""
    if launcher_for is None:
        from .launcher import make_launcher  # fcntl, signal, status: only to act

        launcher_for = make_launcher
    launcher = launcher_for(config, config_path=config_path)
    fields = {"domain": decision.domain, "op": decision.op}
    try:
        if decision.action is Action.START:
            result = launcher.start(decision.domain, decision.domain_id)
        else:
            result = launcher.stop(decision.domain)
    except VmcacheError as err:
        log.error(event("hook.failed", **fields, action=decision.action.value, error=str(err)))
    else:
        log.info(event("hook." + decision.action.value, **fields, result=str(result)))


def _sweep(config: HostConfig, domain: str, xml: bytes) -> None:
    """QEMU is gone: remove what a killed agent of the domain left (nothing while one runs)."""
    from ..host.rungate import uuid_of
    from .leftovers import sweep

    removed = sweep(config, domain, uuid_of(xml))
    if removed:
        log.warning(event("hook.swept", domain=domain, reason="left by an agent that did not stop itself",
                          paths=",".join(removed)))


def _fence(domain: str, xml: bytes, setup_logging: Callable[[], None]) -> None:
    """Fence every earlier run of the domain that has an agent; log only when there was one (else: one listdir).

    Any domain, opted in or not: one that opted out since its last run may
    still have that run's agent.
    """
    from ..host.rungate import fence_runs, uuid_of
    from ..host.runlock import RUN_LOCK_DIR

    uuid = uuid_of(xml)
    fenced = fence_runs(RUN_LOCK_DIR, uuid) if uuid is not None else None
    if fenced is None or not fenced.gates:
        return
    setup_logging()
    log.log(logging.WARNING if fenced.killed else logging.INFO,
            event("hook.fence", domain=domain, runs=fenced.gates, waited=f"{fenced.waited:.3f}s",
                  killed=",".join(map(str, fenced.killed)) or "none"))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of hooks/qemu: ``python -m vmcache.service.hook [--config PATH] DOMAIN OP SUBOP EXTRA``. Always 0."""
    config_path, args = _parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(args, sys.stdin.buffer, sys.stdout.buffer, config_path=config_path)
    except Exception:  # the hook must never fail a domain: log anything and exit 0
        log.exception(event("hook.crashed", args=" ".join(args)))
    return 0


def run_and_exit() -> None:
    """``main()``, then exit at once: libvirtd waits for the hook's exit, the interpreter's teardown only costs time."""
    status = main()
    logging.shutdown()  # flush the log first
    os._exit(status)


if __name__ == "__main__":
    run_and_exit()
