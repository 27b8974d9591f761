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

Dividing the cap by benefit (:meth:`Ledger.divide`): beside ``ledger.json``
a successor file, ``share.json``, holds each agent's demand (budget,
guaranteed minimum, demand curve, last grant; see vmcache.model.share),
written and read under the same lock. It is a separate file so that an
agent of an older vmcache, which rewrites ``ledger.json`` with the fields it
knows, cannot erase the newer agents' curves; its own entry (bytes, no
demand) counts as fixed, off the cap, first come first served as before.
``share.json`` also records the cap, for ``vmcache status``::

    {"version": 1, "cap": 4294967296, "domains": {"web-1": {"pid": 1234,
      "pid_start_time": 5678, "budget": 2147483648, "min": 0, "granted": 1073741824,
      "demand": [[536870912, 480000000], [1073741824, 610000000]]}}}

(written compact, on one line; a benefit is bytes times benefit per byte,
rounded to a whole number).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

from ..errors import HostError
from ..model.share import DEFAULT_KEEP, Curve, Demand, Split, split
from .files import exclusive, write_atomic
from .procs import is_alive, start_time

__all__ = ["Ledger", "LedgerEntry", "HostShare", "SHARE_VERSION"]

SHARE_VERSION = 1
_MAX_POINTS_READ = 256  # a curve longer than this in share.json is damaged: ignored


@dataclass(frozen=True)
class LedgerEntry:
    """What one domain's agent holds."""

    domain: str
    pid: int
    pid_start_time: int | None
    bytes: int


@dataclass
class _State:
    """Both files' live entries, as loaded under the lock."""

    entries: dict[str, LedgerEntry]
    demands: dict[str, Demand]
    owners: dict[str, tuple[int, int | None]] = field(default_factory=dict)  # share.json entries' agents
    cap: int | None = None
    raw: dict[str, object] = field(default_factory=dict)  # entries as read: written back as they were


@dataclass(frozen=True)
class HostShare:
    """The host's split as one agent saw it when it last divided (or as ``vmcache status`` reads it).

    ``held``: bytes each live agent holds in ``ledger.json`` (older agents
    included); ``granted``: what :meth:`Ledger.divide` let this domain hold.
    """

    split: Split
    demands: dict[str, Demand]
    held: dict[str, int]
    granted: int = 0


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
        self._curves: dict[str, tuple[object, Curve]] = {}  # domain -> (points as read, checked curve)

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
        """Drop ``domain``'s entries (its agent stops). Raises HostError."""
        with self._state() as state:
            state.entries.pop(domain, None)
            state.demands.pop(domain, None)

    def forget(self, domain: str) -> list[str]:
        """Remove ``domain`` from both files, also when only a dead agent had it; the files that named it.

        For the hook once the domain's agents are gone: loading drops a dead
        agent's entries from what the others see but writes the files back
        only when something else changes. Raises HostError.
        """
        if not (self._names(self.path, domain) or self._names(self.share_path, domain)):
            return []  # files are replaced whole: a look without the lock is safe, and makes nothing
        named = []
        with self._locked() as entries:
            if self._names(self.path, domain):
                entries.pop(domain, None)
                self._save(entries)
                named.append(self.path)
            if self._names(self.share_path, domain):
                state = self._load_share(entries)
                before = dict(state.demands)
                state.demands.pop(domain, None)
                self._save_share(state, before)
                named.append(self.share_path)
        return named

    @classmethod
    def _names(cls, path: str, domain: str) -> bool:
        data = cls._read_json(path)
        domains = data.get("domains") if isinstance(data, dict) else None
        return isinstance(domains, dict) and domain in domains

    def divide(self, domain: str, demand: Demand, *, held: int = 0, keep: float = DEFAULT_KEEP,
               quantum: int = 0) -> HostShare:
        """Publish ``domain``'s demand, split the cap between all live demands, reserve this domain's grant.

        ``held``: bytes the agent holds now. The reservation recorded is
        ``max(held, grant)`` within what the other agents leave (until the
        agent has unpinned down to a smaller grant, it keeps counting what it
        holds, so the sum of pinned bytes never passes the cap); the agent
        reserves what it really holds after pinning with :meth:`reserve`.
        Returns the split, with ``granted`` = what this domain may pin now
        (at most its split grant). Raises HostError if a file cannot be
        read or written, ValueError for a negative ``held``.
        """
        if held < 0:
            raise ValueError(f"held must be >= 0, not {held}")
        with self._state() as state:
            previous = state.demands.get(domain)
            demands = dict(state.demands)
            demands[domain] = replace(demand, granted=previous.granted if previous else 0)
            fixed = sum(e.bytes for d, e in state.entries.items() if d not in demands)
            result = split(demands, self.cap, fixed=fixed, keep=keep, quantum=quantum)
            target = result.grants[domain]
            others = sum(e.bytes for d, e in state.entries.items() if d != domain)
            room = target if self.cap is None else max(0, self.cap - others)
            granted = min(target, room)
            state.entries[domain] = LedgerEntry(domain, self.pid, self._start_time, max(granted, min(held, room)))
            state.demands[domain] = replace(demand, granted=target)
            state.owners[domain] = (self.pid, self._start_time)
            state.cap = self.cap
            demands[domain] = state.demands[domain]
            held_now = {d: e.bytes for d, e in state.entries.items()}
        return HostShare(result, demands, held_now, granted)

    def host_share(self) -> HostShare:
        """The live demands and holdings, split as the agents split them (``vmcache status``). Raises HostError."""
        with self._state() as state:
            fixed = sum(e.bytes for d, e in state.entries.items() if d not in state.demands)
            cap = state.cap if self.cap is None else self.cap
            result = split(state.demands, cap, fixed=fixed)
            return HostShare(result, dict(state.demands), {d: e.bytes for d, e in state.entries.items()})

    def entries(self) -> dict[str, LedgerEntry]:
        """The live entries, by domain (dead agents' entries are dropped). Raises HostError."""
        with self._locked() as entries:
            return dict(entries)

    @property
    def share_path(self) -> str:
        """The successor file with the agents' demands (beside the ledger)."""
        return os.path.join(os.path.dirname(self.path) or ".", "share.json")

    @contextmanager
    def _state(self) -> Iterator[_State]:
        """Both files under the lock; each is written back when it changed."""
        with self._locked() as entries:
            state = self._load_share(entries)
            before = dict(state.demands)
            cap = state.cap
            yield state
            if (state.demands, state.cap) != (before, cap):
                self._save_share(state, before)

    def _load_share(self, entries: dict[str, LedgerEntry]) -> _State:
        data = self._read_json(self.share_path)
        state = _State(entries=entries, demands={})
        if not isinstance(data, dict) or data.get("version") != SHARE_VERSION:
            return state
        cap = data.get("cap")
        state.cap = cap if isinstance(cap, int) and cap >= 0 else None
        domains = data.get("domains")
        for domain, item in (domains if isinstance(domains, dict) else {}).items():
            try:
                pid, started = int(item["pid"]), item.get("pid_start_time")
                curve = self._checked(domain, item.get("demand", []))
                demand = Demand(budget=int(item["budget"]), minimum=int(item.get("min", 0)), curve=curve,
                                granted=int(item.get("granted", 0)))
            except (TypeError, KeyError, ValueError, AttributeError):
                continue
            if min(demand.budget, demand.minimum, demand.granted) < 0:
                continue
            if pid == self.pid or self._alive(pid, started):
                state.demands[domain] = demand
                state.owners[domain] = (pid, started)
                state.raw[domain] = item
        for gone in self._curves.keys() - state.demands.keys():
            del self._curves[gone]
        return state

    def _checked(self, domain: str, points: object) -> Curve:
        """``_curve(points)``, reusing the last check when another agent's curve did not change."""
        known = self._curves.get(domain)
        if known is not None and known[0] == points:  # list equality runs in C: far cheaper than a check
            return known[1]
        curve = _curve(points)
        self._curves[domain] = (points, curve)
        return curve

    def _save_share(self, state: _State, before: dict[str, Demand]) -> None:
        domains: dict[str, object] = {}
        for d, demand in sorted(state.demands.items()):
            if d in state.raw and before.get(d) == demand:  # another agent's entry, unchanged
                domains[d] = state.raw[d]
                continue
            pid, started = state.owners.get(d, (self.pid, self._start_time))
            domains[d] = {"pid": pid, "pid_start_time": started, "budget": demand.budget, "min": demand.minimum,
                          "granted": demand.granted, "demand": [[b, round(v)] for b, v in demand.curve]}
        # compact: json's C encoder (indent= takes the pure-Python one: 28 of 32 ms for 100 domains)
        self._write_json(self.share_path, {"version": SHARE_VERSION, "cap": state.cap, "domains": domains},
                         indent=None)

    @contextmanager
    def _locked(self) -> Iterator[dict[str, LedgerEntry]]:
        with exclusive(self.path, "ledger"):
            entries = self._load()
            before = dict(entries)
            yield entries
            if entries != before:
                self._save(entries)

    @staticmethod
    def _read_json(path: str) -> object:
        try:
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        except FileNotFoundError:
            return {}
        except OSError as err:
            raise HostError(f"cannot read ledger: {err.strerror}", path=path, errno=err.errno) from err
        except ValueError:  # damaged (not JSON): rebuilt, live agents re-reserve every cycle
            return {}

    def _load(self) -> dict[str, LedgerEntry]:
        data = self._read_json(self.path)
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
        self._write_json(self.path, data)

    @staticmethod
    def _write_json(path: str, data: object, *, indent: int | None = 1) -> None:
        # no fsync: it lives in the runtime directory (/run, a tmpfs) and is rewritten every cycle
        write_atomic(path, json.dumps(data, indent=indent), fsync=False, what="ledger")


def _curve(points: object) -> Curve:
    """A curve from share.json: ``[[bytes, benefit], ...]``, bytes rising, benefit never falling.

    One agent reads every other agent's curve each cycle (100 domains of 32
    points): plain comprehensions, ~40 us a curve. Raises ValueError
    (or TypeError) for anything else.
    """
    if not isinstance(points, list) or len(points) > _MAX_POINTS_READ:
        raise ValueError("not a bounded list of points")
    if not points:
        return ()
    if not all(isinstance(p, list) and len(p) == 2 for p in points):
        raise ValueError("not a list of [bytes, benefit] points")
    sizes = [int(p[0]) for p in points]
    values = [float(p[1]) for p in points]
    rising = all(a < b for a, b in zip(sizes, sizes[1:])) and all(a <= b for a, b in zip(values, values[1:]))
    if not rising or sizes[0] <= 0 or not values[0] >= 0.0 or not math.isfinite(values[-1]):
        raise ValueError("not a demand curve")
    return tuple(zip(sizes, values))
