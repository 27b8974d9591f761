"""Per-agent status files: what `vmcache status` shows (schema, atomic write, read).

Each agent keeps ``<runtime_dir>/agents/<stem>.json`` up to date (after
every cycle and on every state change), where ``<stem>`` is
:func:`vmcache.host.files.file_stem` of the domain name; the launcher's pidfile is
``<stem>.pid`` beside it. The file is replaced atomically (write to a
temporary file, fsync, rename), so a reader never sees half of one.

Schema (version 1), all sizes in bytes, times in seconds since the epoch::

    {"version": 1, "domain": "web-1", "uuid": "...", "pid": 1234,
     "pid_start_time": 5678,          # /proc/PID/stat starttime (pid reuse check)
     "state": "running",              # starting | running | backing-off | stopping | disabled
     "started_at": 1700000000.0, "updated_at": 1700000100.0,
     "interval": 10.0, "budget_bytes": 2147483648, "granted_bytes": 2147483648,
     "demand_bytes": 1073741824,      # what its demand curve asks of the host cap
     "minimum_bytes": 0,              # its guaranteed share (metadata min=)
     "share_error": null,             # e.g. the minimums of all domains exceed the cap
     "metrics_url": "http://127.0.0.1:9470/metrics", "last_error": null,
     "managed_by": "rule 2: nova_flavor=m1.large",   # or "metadata": why vmcache manages it
     "hotset_saved_at": 1700000090.0, "hotset_source": "host",  # live | persistent | host: what it warmed from
     "read_signal": "probe",          # the guest's reads: probe | tracepoint (counted) | inferred
     "read_signal_reason": null,      # why they are inferred
     "disks": [{"target": "vda", "source": "/var/lib/libvirt/images/web-1.img",
                "cache": "writethrough", "eligible": true, "reason": null,
                "size_bytes": 21474836480,
                "budget_bytes": 2147483648, "pinned_bytes": 0, "resident_bytes": 0,
                "dirtied_bytes_per_second": 0.0, "dirty_granule_bytes": 65536,
                "last_cycle_seconds": 0.012,
                "guest_read_bytes": 41943040,       # since the agent started; null: not counted
                "guest_read_hit_bytes": 37748736,   # of those, found in the page cache
                "read_bytes_per_second": 0.0,
                "last_cycle_at": 1700000100.0, "error": null}]}

``dirtied_bytes_per_second`` counts whole dirty-bitmap granules of
``dirty_granule_bytes`` the guest wrote into (not its write throughput: a
scattered 4 KiB write dirties a 64 KiB granule). Agents before issue 14
wrote it as ``write_bytes_per_second``, which is still read.

Unknown keys are ignored on reading (newer agents may add some).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from ..errors import HostError
from ..host.files import file_stem, write_atomic
from ..host.procs import is_alive, start_time

if TYPE_CHECKING:  # an annotation only: status readers need not load the model
    from ..model.pinvalue import PinWorth
    from ..model.stats import CycleStats

__all__ = [
    "SCHEMA_VERSION",
    "STATES",
    "DiskStatus",
    "AgentStatus",
    "AgentEntry",
    "status_path",
    "write_status",
    "read_status",
    "read_statuses",
]

SCHEMA_VERSION = 1
STATES = ("starting", "migrating", "running", "backing-off", "stopping", "disabled")


def status_path(agents_dir: str, domain: str) -> str:
    """Where the agent of ``domain`` writes its status."""
    return os.path.join(agents_dir, file_stem(domain) + ".json")


@dataclass
class DiskStatus:
    """One disk of an agent: managed (``eligible``) or skipped with a ``reason``."""

    target: str
    source: str | None
    cache: str
    eligible: bool
    reason: str | None = None
    budget_bytes: int = 0
    pinned_bytes: int = 0
    locked_bytes: int | None = None  # of the pinned bytes, those held (None: not reported)
    resident_bytes: int = 0
    dirtied_bytes_per_second: float = 0.0
    dirty_granule_bytes: int | None = None
    last_cycle_seconds: float | None = None
    last_cycle_at: float | None = None
    cycles: int = 0                # engine cycles run: tests and operators count cycles, not seconds
    error: str | None = None
    warm_restored_bytes: int = 0   # of the saved hot set this disk started from, pinned so far
    warm_total_bytes: int = 0      # bytes of that saved set (0: the disk started cold)
    image_deleted: bool = False    # no path names the image file any more
    layer_of: str | None = None    # a read-only backing layer of this target's top image (None: the top)
    size_bytes: int | None = None  # of the image file (None: not scanned yet)
    guest_read_bytes: int | None = None      # read by the guest since the agent started (None: not counted)
    guest_read_hit_bytes: int | None = None  # of those, found in the page cache
    read_bytes_per_second: float | None = None  # in the last cycle
    pin_saved_bytes: int | None = None  # of the hits, those the kernel alone would likely have missed (estimate)
    pin_cost_bytes: int | None = None   # refaults the pins caused the others under their limit (estimate)
    kernel_retention_seconds: float | None = None  # how long the kernel keeps an unpinned page read again

    def update_reads(self, read_bytes: int, hit_bytes: int, *, elapsed: float, worth: PinWorth | None = None
                     ) -> None:
        """Add one cycle's counted reads of the guest; ``elapsed`` seconds since the previous cycle;
        ``worth``: what the pins were worth in it (vmcache.model.pinvalue; None: not judged)."""
        self.guest_read_bytes = (self.guest_read_bytes or 0) + read_bytes
        self.guest_read_hit_bytes = (self.guest_read_hit_bytes or 0) + hit_bytes
        self.read_bytes_per_second = read_bytes / elapsed if elapsed > 0 else 0.0
        if worth is None:
            return
        self.pin_saved_bytes = (self.pin_saved_bytes or 0) + worth.saved_bytes
        if worth.cost_bytes is not None:
            self.pin_cost_bytes = (self.pin_cost_bytes or 0) + worth.cost_bytes
        # JSON has no infinity: a kernel that kept every page read again is reported as -1
        retention = worth.retention
        self.kernel_retention_seconds = None if retention is None else -1.0 if math.isinf(retention) else retention

    def update(self, stats: CycleStats, *, elapsed: float, wall_time: float) -> None:
        """Take the figures of one engine cycle; ``elapsed`` seconds since the previous one."""
        self.budget_bytes = stats.budget_bytes
        self.size_bytes = stats.size_bytes
        self.pinned_bytes = stats.pinned_bytes
        self.locked_bytes = stats.locked_bytes
        self.resident_bytes = stats.resident_bytes
        self.dirtied_bytes_per_second = stats.guest_written_bytes / elapsed if elapsed > 0 else 0.0
        self.last_cycle_seconds = stats.duration_seconds
        self.last_cycle_at = wall_time
        self.cycles += 1
        self.error = stats.error
        self.warm_restored_bytes = stats.warm_restored_bytes
        self.warm_total_bytes = stats.warm_total_bytes


@dataclass
class AgentStatus:
    """What one agent says about itself."""

    domain: str
    pid: int
    uuid: str = ""
    domain_id: int | None = None  # the domain run (libvirt id) the agent is bound to
    state: str = "starting"
    pid_start_time: int | None = None
    started_at: float = 0.0
    updated_at: float = 0.0
    interval: float | None = None
    budget_bytes: int = 0
    granted_bytes: int = 0
    demand_bytes: int | None = None  # None: an agent from before issue 14 (no demand published)
    minimum_bytes: int = 0
    share_error: str | None = None
    metrics_url: str | None = None
    last_error: str | None = None
    hotset_saved_at: float | None = None  # wall time the agent last saved the domain's hot set
    hotset_source: str | None = None  # where the set it warmed from came from: live, persistent, host
    managed_by: str | None = None  # why vmcache manages the domain: "metadata", "rule 2: nova_flavor=m1.large"
    read_signal: str = "inferred"  # the guest's reads: counted ("probe", "tracepoint") or "inferred" (residency)
    read_signal_reason: str | None = None  # why they are inferred
    disks: list[DiskStatus] = field(default_factory=list)
    version: int = SCHEMA_VERSION

    @property
    def pinned_bytes(self) -> int:
        return sum(d.pinned_bytes for d in self.disks)

    @property
    def locked_bytes(self) -> int | None:
        """Of :attr:`pinned_bytes`, those held; None when no disk reported it."""
        if all(d.locked_bytes is None for d in self.disks):
            return None
        return sum(d.pinned_bytes if d.locked_bytes is None else d.locked_bytes for d in self.disks)

    @property
    def resident_bytes(self) -> int:
        return sum(d.resident_bytes for d in self.disks)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> AgentStatus:
        """Build from a decoded status file; ValueError if it does not fit the schema."""
        if not isinstance(data, dict):
            raise ValueError("not an object")
        if data.get("version") != SCHEMA_VERSION:
            raise ValueError(f"schema version {data.get('version')!r}, expected {SCHEMA_VERSION}")
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        disk_known = {f.name for f in fields(DiskStatus)}
        disks = values.get("disks", [])
        if not isinstance(disks, list) or not all(isinstance(d, dict) for d in disks):
            raise ValueError("disks is not a list of objects")
        try:
            values["disks"] = [DiskStatus(**{k: v for k, v in _renamed(d).items() if k in disk_known}) for d in disks]
            status = cls(**values)
        except TypeError as err:  # a required field is missing
            raise ValueError(str(err)) from None
        if not isinstance(status.domain, str) or not isinstance(status.pid, int):
            raise ValueError("domain or pid has the wrong type")
        return status


def _renamed(disk: dict[str, Any]) -> dict[str, Any]:
    """A disk entry with the names of this schema (older agents wrote ``write_bytes_per_second``)."""
    if "write_bytes_per_second" in disk and "dirtied_bytes_per_second" not in disk:
        disk = dict(disk, dirtied_bytes_per_second=disk["write_bytes_per_second"])
    return disk


def write_status(path: str, status: AgentStatus, *, now: float | None = None) -> None:
    """Replace the status file at ``path`` atomically.

    Fills ``updated_at`` (``now``, default the wall clock) and, when unset,
    ``pid_start_time`` from /proc. Raises HostError if it cannot be written.
    """
    status.updated_at = time.time() if now is None else now
    if status.pid_start_time is None:
        status.pid_start_time = start_time(status.pid)
    text = json.dumps(status.to_json(), indent=1, sort_keys=True) + "\n"
    write_atomic(path, text, make_dirs=True, what="status")


@dataclass(frozen=True)
class AgentEntry:
    """A status file as `vmcache status` shows it: ``running`` is checked against /proc now."""

    path: str
    status: AgentStatus | None
    running: bool
    problem: str | None = None


def read_status(path: str) -> AgentStatus:
    """Read one status file; HostError if it cannot be read, ValueError if it does not fit the schema."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as err:
        raise HostError(f"cannot read status: {err.strerror}", path=path, errno=err.errno) from err
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"not JSON: {err}") from None
    return AgentStatus.from_json(data)


def read_statuses(agents_dir: str, *, proc: str = "/proc") -> list[AgentEntry]:
    """Every status file under ``agents_dir``, sorted by domain; an absent directory is empty.

    An agent whose pid is gone (or was reused) has ``running=False``; a
    file that cannot be read or decoded is listed with ``problem`` set.
    """
    try:
        names = sorted(n for n in os.listdir(agents_dir) if n.endswith(".json") and not n.startswith("."))
    except FileNotFoundError:
        return []
    except OSError as err:
        raise HostError(f"cannot list agents: {err.strerror}", path=agents_dir, errno=err.errno) from err
    entries = []
    for name in names:
        path = os.path.join(agents_dir, name)
        try:
            status = read_status(path)
        except FileNotFoundError:
            continue  # the agent removed it meanwhile
        except (HostError, ValueError) as err:
            entries.append(AgentEntry(path=path, status=None, running=False, problem=str(err)))
            continue
        running = is_alive(status.pid, status.pid_start_time, proc=proc)
        entries.append(AgentEntry(path=path, status=status, running=running))
    entries.sort(key=lambda e: e.status.domain if e.status else os.path.basename(e.path))
    return entries
