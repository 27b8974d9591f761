"""QEMU's monitor: one interface, two transports.

``LibvirtMonitor`` talks to a libvirt domain's QEMU through
``libvirt_qemu.qemuMonitorCommand`` (libvirt owns the monitor socket);
``SocketMonitor`` talks to plain QEMU or qemu-storage-daemon over a QMP unix
socket with qemu.qmp. Both send only the commands of an allow-list
(``ALLOWED_COMMANDS``) and translate their transport's errors into
vmcache's own::

    MonitorError
     +-- MonitorConnectionError   cannot connect, timed out, connection lost
     +-- QMPCommandError          QEMU answered {"error": ...}
     +-- CommandNotAllowedError   the command is not on the allow-list

``hmp()`` runs a human-monitor command line (tests use it for ``qemu-io``);
it is refused unless the monitor was built with ``TEST_COMMANDS``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, Final, Protocol, runtime_checkable

from ..errors import CommandNotAllowedError, MonitorConnectionError, MonitorError, QMPCommandError
from ..logfmt import event

if TYPE_CHECKING:
    import asyncio

__all__ = [
    "ALLOWED_COMMANDS",
    "TRANSACTION_ACTIONS",
    "TEST_COMMANDS",
    "DEFAULT_TIMEOUT",
    "Monitor",
    "SocketMonitor",
    "LibvirtMonitor",
    "check_command",
    "hmp",
]

#: Every QMP command vmcache sends, and nothing else.
ALLOWED_COMMANDS: Final = frozenset(
    {
        "query-named-block-nodes",
        "query-block",
        "query-block-exports",
        "block-dirty-bitmap-add",
        "block-dirty-bitmap-disable",
        "block-dirty-bitmap-merge",
        "block-dirty-bitmap-remove",
        "transaction",
        "blockdev-add",
        "blockdev-del",
        "nbd-server-start",
        "nbd-server-stop",
        "block-export-add",
        "block-export-del",
    }
)

#: The actions vmcache puts inside a ``transaction``.
TRANSACTION_ACTIONS: Final = frozenset(
    {
        "block-dirty-bitmap-add",
        "block-dirty-bitmap-disable",
        "block-dirty-bitmap-merge",
        "block-dirty-bitmap-remove",
    }
)

#: For tests and operator tools only: the allow-list plus HMP (``qemu-io``).
TEST_COMMANDS: Final = ALLOWED_COMMANDS | {"human-monitor-command"}

#: Seconds to wait for a connection or a reply before MonitorConnectionError.
DEFAULT_TIMEOUT: Final = 10.0

_log = logging.getLogger(__name__)


@runtime_checkable
class Monitor(Protocol):
    """What the tracker and discovery need from a QEMU monitor."""

    def execute(self, command: str, arguments: Mapping[str, Any] | None = None) -> Any:
        """Run one QMP command and return its ``return`` value.

        Raises CommandNotAllowedError, QMPCommandError, MonitorConnectionError.
        """
        ...

    def close(self) -> None:
        """Let go of the monitor (idempotent)."""
        ...


def check_command(command: str, arguments: Mapping[str, Any] | None, allowed: frozenset[str]) -> None:
    """Raise CommandNotAllowedError unless ``command`` (and each transaction action) is allowed."""
    if command not in allowed:
        raise CommandNotAllowedError(command)
    if command == "transaction":
        for action in (arguments or {}).get("actions", []):
            kind = action.get("type", "")
            if kind not in TRANSACTION_ACTIONS or kind not in allowed:
                raise CommandNotAllowedError(f"transaction/{kind}")


class SocketMonitor:
    """A QMP client on a unix socket (plain QEMU, qemu-storage-daemon).

    Runs qemu.qmp on a private event loop, every call bounded by
    ``timeout`` seconds. Usable as a context manager; ``connect()`` is
    called on entry if it was not called before.
    """

    def __init__(
        self,
        path: str,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        allowed: frozenset[str] = ALLOWED_COMMANDS,
        logger: logging.Logger | None = None,
    ) -> None:
        self.path = path
        self.timeout = timeout
        self.allowed = allowed
        self._log = logger or _log
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: Any = None

    def connect(self) -> None:
        """Connect and negotiate; raises MonitorConnectionError."""
        if self._client is not None:
            return
        import asyncio  # only plain QEMU sockets need it: an agent talking through libvirt never loads it

        from qemu.qmp import QMPClient, QMPError

        self._loop = asyncio.new_event_loop()
        client = QMPClient("vmcache")
        try:
            self._run(client.connect(self.path))
        except (QMPError, OSError, TimeoutError) as err:
            self._shutdown_loop(client)
            raise MonitorConnectionError(f"cannot connect to QMP socket {self.path}: {err}") from err
        self._client = client
        self._log.debug(event("qmp.connect", path=self.path))

    def execute(self, command: str, arguments: Mapping[str, Any] | None = None) -> Any:
        """Run one command; see ``Monitor.execute``."""
        check_command(command, arguments, self.allowed)
        if self._client is None:
            self.connect()
        from qemu.qmp import ExecuteError, QMPError

        args = dict(arguments) if arguments else None
        try:
            return self._run(self._client.execute(command, args))
        except ExecuteError as err:
            raise QMPCommandError(command, err.error_class, str(err)) from err
        except TimeoutError as err:
            # The reply may still come and would be taken for the next one's.
            self.close()
            raise MonitorConnectionError(f"{command}: no reply from {self.path} in {self.timeout:g}s") from err
        except (QMPError, OSError, EOFError) as err:
            self.close()
            raise MonitorConnectionError(f"{command}: connection to {self.path} lost: {err}") from err

    def close(self) -> None:
        """Disconnect (idempotent, never raises)."""
        client, self._client = self._client, None
        if self._loop is not None:
            self._shutdown_loop(client)

    def __enter__(self) -> SocketMonitor:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, coro: Any) -> Any:
        assert self._loop is not None
        import asyncio

        return self._loop.run_until_complete(asyncio.wait_for(coro, self.timeout))

    def _shutdown_loop(self, client: Any) -> None:
        loop, self._loop = self._loop, None
        if loop is None:
            return
        try:
            if client is not None:
                import asyncio

                from qemu.qmp import QMPError

                try:
                    loop.run_until_complete(asyncio.wait_for(client.disconnect(), self.timeout))
                except (QMPError, OSError, EOFError, TimeoutError) as err:
                    self._log.debug(event("qmp.disconnect_error", path=self.path, error=err))
        finally:
            loop.close()


class LibvirtMonitor:
    """QMP through libvirt for one domain (``virDomainQemuMonitorCommand``).

    libvirt owns the domain's monitor socket; this sends JSON commands
    through it. ``domain`` is a ``libvirt.virDomain``.
    """

    def __init__(
        self,
        domain: Any,
        *,
        allowed: frozenset[str] = ALLOWED_COMMANDS,
        logger: logging.Logger | None = None,
        guard: Callable[[], AbstractContextManager[None]] | None = None,
    ) -> None:
        """``guard()`` is entered around every command and raises MonitorError to hold it back
        (the agent's: the domain runs as another QEMU process than the one it was started for)."""
        self.domain = domain
        self.allowed = allowed
        self._log = logger or _log
        self._guard = guard

    @classmethod
    def open(
        cls, name: str, *, uri: str = "qemu:///system", allowed: frozenset[str] = ALLOWED_COMMANDS
    ) -> LibvirtMonitor:
        """Look the domain up by name; raises MonitorConnectionError."""
        import libvirt

        try:
            conn = libvirt.open(uri)
            domain = conn.lookupByName(name)
        except libvirt.libvirtError as err:
            raise MonitorConnectionError(f"libvirt {uri}: domain {name}: {err.get_error_message() or err}") from err
        return cls(domain, allowed=allowed)

    def execute(self, command: str, arguments: Mapping[str, Any] | None = None) -> Any:
        """Run one command; see ``Monitor.execute``."""
        check_command(command, arguments, self.allowed)
        import libvirt
        import libvirt_qemu

        message: dict[str, Any] = {"execute": command}
        if arguments:
            message["arguments"] = dict(arguments)
        try:
            with self._guard() if self._guard is not None else nullcontext():
                text = libvirt_qemu.qemuMonitorCommand(
                    self.domain, json.dumps(message), libvirt_qemu.VIR_DOMAIN_QEMU_MONITOR_COMMAND_DEFAULT
                )
        except libvirt.libvirtError as err:
            raise MonitorConnectionError(f"{command}: libvirt: {err.get_error_message() or err}") from err
        try:
            reply = json.loads(text)
        except ValueError as err:
            raise MonitorError(f"{command}: libvirt returned no JSON: {text[:80]!r}") from err
        if "error" in reply:
            error = reply["error"]
            raise QMPCommandError(command, error.get("class", "GenericError"), error.get("desc", ""))
        return reply.get("return")

    def close(self) -> None:
        """Nothing to release: the libvirt connection belongs to the caller."""


def hmp(monitor: Monitor, command_line: str) -> str:
    """Run one human-monitor command line and return its output.

    Only monitors built with ``allowed=TEST_COMMANDS`` accept it. Raises
    QMPCommandError when HMP printed an error (HMP reports errors as text).
    """
    output = monitor.execute("human-monitor-command", {"command-line": command_line})
    text = str(output or "")
    lowered = text.lower()
    if "error" in lowered or "failed" in lowered or "not found" in lowered:
        raise QMPCommandError("human-monitor-command", "HMPError", text.strip())
    return text
