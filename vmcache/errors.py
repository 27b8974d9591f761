"""The exceptions vmcache raises.

Foreign errors (``libvirt.libvirtError``, ``qemu.qmp`` errors, ``OSError``
from system calls) are translated once, at the edge that met them, with
``raise ... from err``. Everything above the edge sees only this tree::

    VmcacheError
     +-- ConfigError            bad operator input (option, YAML key, metadata)
     +-- HostError              a system call on this host failed
     |    +-- PageCacheError    cachestat / mincore / mmap of an image
     |    +-- PinError          mlock / munlock
     +-- MonitorError           talking to QEMU's monitor
     |    +-- MonitorConnectionError   cannot reach it / it went away
     |    |    +-- MonitorRunOverError   the agent's run of the domain is over: not sent
     |    +-- MonitorBusyError  libvirt is busy with a job of the domain: not sent
     |    +-- QMPCommandError   QEMU answered a command with an error
     |    +-- CommandNotAllowedError   vmcache refused to send a command
     |    +-- DiskNotFoundError a block node / image file is not in QEMU
     +-- TrackerError           dirty-bitmap tracking
     |    +-- BitmapReadError   a bitmap could not be read this cycle
     +-- DomainError            libvirt domain lookup / XML
     |    +-- RunEndedError     the run an agent was started for is over
     |    +-- RunClaimedError   another agent already manages that run
"""

from __future__ import annotations

__all__ = [
    "VmcacheError",
    "ConfigError",
    "HostError",
    "PageCacheError",
    "PinError",
    "MonitorError",
    "MonitorConnectionError",
    "MonitorRunOverError",
    "MonitorBusyError",
    "QMPCommandError",
    "CommandNotAllowedError",
    "DiskNotFoundError",
    "TrackerError",
    "BitmapReadError",
    "DomainError",
    "RunEndedError",
    "RunClaimedError",
]


class VmcacheError(Exception):
    """Base of every error vmcache raises on purpose."""


class ConfigError(VmcacheError):
    """An option, YAML key or metadata value is not acceptable.

    ``str()`` is one line naming the key and the offending value, fit to
    show an operator as it is.
    """

    def __init__(self, key: str, value: object, reason: str) -> None:
        super().__init__(key, value, reason)
        self.key = key
        self.value = value
        self.reason = reason

    def __str__(self) -> str:
        shown = repr(self.value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        return f"{self.key}: {shown}: {self.reason}"


class HostError(VmcacheError):
    """A system call on this host failed; ``errno`` when the OS gave one."""

    def __init__(self, message: str, *, path: str | None = None, errno: int | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.errno = errno

    def __str__(self) -> str:
        where = f" ({self.path})" if self.path else ""
        return f"{self.args[0]}{where}"


class PageCacheError(HostError):
    """Reading page-cache residency of an image failed."""


class PinError(HostError):
    """Locking or unlocking a range of an image in memory failed."""


class MonitorError(VmcacheError):
    """Talking to a QEMU monitor failed."""


class MonitorConnectionError(MonitorError):
    """The monitor could not be reached, or the connection was lost."""


class MonitorRunOverError(MonitorConnectionError):
    """The run of the domain an agent was started for is not running any more (the domain stopped, or runs as
    a new QEMU): the command was not sent. The agent stops at its next look at the domain's events."""


class MonitorBusyError(MonitorError):
    """libvirt runs a job of the domain (a snapshot revert, a save, another client's command): the command
    was not sent, because it would wait for that job - and the job may be waiting for this agent (the
    hook's fence of a new run)."""


class QMPCommandError(MonitorError):
    """QEMU answered a QMP command with an error.

    Carries the command sent, QEMU's error class and its description.
    """

    def __init__(self, command: str, error_class: str, desc: str) -> None:
        super().__init__(command, error_class, desc)
        self.command = command
        self.error_class = error_class
        self.desc = desc

    def __str__(self) -> str:
        return f"{self.command}: {self.error_class}: {self.desc}"


class CommandNotAllowedError(MonitorError):
    """vmcache refused to send a QMP command that is not on its allow-list.

    A programming error, never QEMU's: only a fixed set of commands is sent.
    """

    def __init__(self, command: str) -> None:
        super().__init__(command)
        self.command = command

    def __str__(self) -> str:
        return f"{self.command}: not a command vmcache sends"


class DiskNotFoundError(MonitorError):
    """No block node of QEMU matches the node name or image file asked for."""

    def __init__(self, wanted: str, known: list[str] | None = None) -> None:
        super().__init__(wanted, known or [])
        self.wanted = wanted
        self.known = known or []

    def __str__(self) -> str:
        known = ", ".join(self.known) if self.known else "none"
        return f"{self.wanted}: no such block node or image (known: {known})"


class TrackerError(VmcacheError):
    """Dirty-bitmap tracking of a disk failed."""


class BitmapReadError(TrackerError):
    """A disabled bitmap could not be read this cycle; it is kept for later."""


class DomainError(VmcacheError):
    """A libvirt domain could not be looked up or its XML is unusable."""


class DomainGoneError(DomainError):
    """The libvirt domain no longer exists (a transient domain that stopped, or an undefined one)."""


class RunEndedError(DomainError):
    """The domain run an agent was started for is over (the domain stopped, or runs again as a new run)."""


class RunClaimedError(DomainError):
    """Another live agent manages this run of the domain already (started with another host config)."""
