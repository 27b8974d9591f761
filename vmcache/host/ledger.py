"""The host-wide cap on pinned bytes, shared by all agents through a ledger file.

One JSON file (``<runtime_dir>/ledger.json``) records, per domain, the
bytes its agent holds and the agent's pid and start time. Every change
happens under ``fcntl.flock`` on ``ledger.json.lock`` and the file is
replaced atomically. Entries of agents that died (pid gone, or reused by
another process) are dropped on the next change, so a crashed agent never
holds its share for ever.

An agent calls :meth:`Ledger.reserve` with the total it wants to hold
before it pins more, and again with what it really holds after; it gets at
most ``cap - (what live agents of other domains hold)``. It calls
:meth:`Ledger.release` when it stops.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ..errors import HostError
from .procs import is_alive, start_time

__all__ = ["Ledger", "LedgerEntry"]


@dataclass(frozen=True)
class LedgerEntry:
    """What one domain's agent holds."""

    domain: str
    pid: int
    pid_start_time: int | None
    bytes: int


class Ledger:
    """The shared ledger at ``path`` with a host-wide ``cap`` in bytes (None: no cap).

    ``pid`` is the agent's own pid; ``alive(pid, start_time)`` tells whether
    another entry's agent still runs (default: /proc).
    """

    def __init__(
        self,
        path: str,
        cap: int | None,
        *,
        pid: int | None = None,
        alive: Callable[[int, int | None], bool] = is_alive,
    ) -> None:
        self.path = path
        self.cap = cap
        self.pid = os.getpid() if pid is None else pid
        self._start_time = start_time(self.pid)
        self._alive = alive

    def reserve(self, domain: str, want: int) -> int:
        """Set ``domain``'s holding to as much of ``want`` bytes as the cap allows; return it.

        Raises HostError if the ledger cannot be read or written.
        """
        if want < 0:
            raise ValueError(f"want must be >= 0, not {want}")
        with self._locked() as entries:
            others = sum(e.bytes for d, e in entries.items() if d != domain)
            granted = want if self.cap is None else max(0, min(want, self.cap - others))
            entries[domain] = LedgerEntry(domain, self.pid, self._start_time, granted)
        return granted

    def release(self, domain: str) -> None:
        """Drop ``domain``'s entry (its agent stops). Raises HostError."""
        with self._locked() as entries:
            entries.pop(domain, None)

    def entries(self) -> dict[str, LedgerEntry]:
        """The live entries, by domain (dead agents' entries are dropped). Raises HostError."""
        with self._locked() as entries:
            return dict(entries)

    @contextmanager
    def _locked(self) -> Iterator[dict[str, LedgerEntry]]:
        directory = os.path.dirname(self.path) or "."
        try:
            os.makedirs(directory, mode=0o755, exist_ok=True)
            lock_fd = os.open(self.path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as err:
            raise HostError(f"cannot open ledger lock: {err.strerror}", path=self.path, errno=err.errno) from err
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            entries = self._load()
            before = dict(entries)
            yield entries
            if entries != before:
                self._save(entries)
        finally:
            os.close(lock_fd)  # releases the flock

    def _load(self) -> dict[str, LedgerEntry]:
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            return {}
        except OSError as err:
            raise HostError(f"cannot read ledger: {err.strerror}", path=self.path, errno=err.errno) from err
        except ValueError:  # damaged (not JSON): rebuilt, live agents re-reserve every cycle
            return {}
        entries: dict[str, LedgerEntry] = {}
        domains = data.get("domains") if isinstance(data, dict) else None
        for domain, item in (domains if isinstance(domains, dict) else {}).items():
            try:
                entry = LedgerEntry(domain, int(item["pid"]), item.get("pid_start_time"), int(item["bytes"]))
            except (TypeError, KeyError, ValueError):
                continue
            if entry.pid == self.pid or self._alive(entry.pid, entry.pid_start_time):
                entries[domain] = entry
        return entries

    def _save(self, entries: dict[str, LedgerEntry]) -> None:
        data = {"domains": {d: {"pid": e.pid, "pid_start_time": e.pid_start_time, "bytes": e.bytes}
                            for d, e in sorted(entries.items())}}
        directory = os.path.dirname(self.path) or "."
        try:
            fd, tmp = tempfile.mkstemp(prefix=".ledger-", dir=directory)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump(data, f, indent=1)
                os.chmod(tmp, 0o644)
                os.replace(tmp, self.path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as err:
            raise HostError(f"cannot write ledger: {err.strerror}", path=self.path, errno=err.errno) from err
