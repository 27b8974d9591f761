"""The host's warm-up budget: one token bucket per backing device, shared by every agent (a flock'd file).

``<runtime_dir>/warmup.json`` holds, per backing device (the ``st_dev`` of
the image file: the file system or block device the reads go to), the
tokens left, when they were last filled, and the ask of every disk
waiting to restore a saved hot set::

    {"version": 1, "devices": {"254:0": {"tokens": 335544320.0, "at": 1796170571.3,
      "asks": {"/var/lib/libvirt/images/web-1.qcow2": {"want": 33554432, "priority": 0.91, "at": 1796170570.1,
                                                        "owner": "web-1"}}}}}

The bucket fills at ``rate`` bytes per second and holds at most ``burst``
seconds' worth. Every change happens under the file's flock
(vmcache.host.files.exclusive) and the file is replaced atomically. Who
gets the tokens is vmcache.model.warmshare's: the densest saved region
first. A disk asks again every cycle while it restores; an ask not renewed
for two of its cycles (its agent stopped or died) holds nothing back.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

from ..errors import HostError
from ..model.warmshare import DeviceBudget, WarmAsk
from .files import exclusive, write_atomic

__all__ = ["WarmPool", "device_of"]

VERSION = 1


def device_of(fd: int) -> str:
    """The backing device of the open file ``fd`` as the pool names it, ``MAJOR:MINOR``. Raises OSError."""
    st = os.fstat(fd)
    return f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"


class WarmPool:
    """The warm-up budget of this host's agents: :meth:`take` before a cycle loads, :meth:`give_back` after."""

    def __init__(self, path: str, rate: float, *, burst: float, clock: Callable[[], float] = time.time) -> None:
        """``rate``: bytes per second per device; ``burst``: seconds of ``rate`` the bucket holds (and how
        long an ask stays fresh, twice over)."""
        self.path = path
        self.rate = float(rate)
        self.burst = burst
        self._clock = clock

    def take(self, device: str, who: str, want: int, priority: float, owner: str = "") -> int:
        """Ask for ``want`` bytes of ``device``'s budget for disk ``who`` of domain ``owner``; the bytes granted
        (taken now). Raises HostError when the file cannot be read or written.
        """
        with exclusive(self.path, "warm-up budget"):
            state = self._load()
            now = self._clock()
            raw = state.get(device)
            dev = DeviceBudget.full(self.rate, self.burst, now) if raw is None else _budget(raw)
            granted = dev.take(who, want, priority, now, rate=self.rate, burst=self.burst)
            state[device] = _entry(dev, _owners(raw) | {who: owner})
            self._save(state)
        return granted

    def give_back(self, device: str, who: str, unused: int) -> None:
        """Return bytes ``who`` took but did not read (a cycle pays only for what it loads): it wanted less
        than it asked, so its ask waits no more this cycle. Raises HostError."""
        if unused <= 0:
            return
        with exclusive(self.path, "warm-up budget"):
            state = self._load()
            if device in state:
                raw = state[device]
                dev = _budget(raw)
                dev.give_back(who, unused, rate=self.rate, burst=self.burst)
                state[device] = _entry(dev, _owners(raw))
                self._save(state)

    def forget(self, who: str) -> None:
        """Drop ``who``'s asks (its disk stopped restoring, or its agent stops). Raises HostError."""
        self._drop(lambda key, _ask: key == who)

    def forget_owner(self, owner: str) -> list[str]:
        """Drop every ask of domain ``owner`` (a killed agent's, at its domain's release); the disks dropped.
        Raises HostError."""
        return self._drop(lambda _key, ask: ask.get("owner") == owner)

    def _drop(self, which: Callable[[str, dict[str, Any]], bool]) -> list[str]:
        if not os.path.exists(self.path):
            return []
        with exclusive(self.path, "warm-up budget"):
            state = self._load()
            dropped = [k for dev in state.values() for k, a in dev["asks"].items() if which(k, a)]
            if dropped:
                for dev in state.values():
                    dev["asks"] = {k: a for k, a in dev["asks"].items() if not which(k, a)}
                self._save(state)
        return dropped

    def _load(self) -> dict[str, dict[str, Any]]:
        try:
            with open(self.path, encoding="utf-8") as f:
                raw = json.load(f)
        except FileNotFoundError:
            return {}
        except ValueError:  # a damaged file is rebuilt: every budget starts full again
            return {}
        except OSError as err:
            raise HostError(f"cannot read the warm-up budget: {err.strerror}", path=self.path,
                            errno=err.errno) from err
        devices = raw.get("devices") if isinstance(raw, dict) and raw.get("version") == VERSION else None
        if not isinstance(devices, dict):
            return {}
        return {k: v for k, v in devices.items() if isinstance(v, dict) and _valid(v)}

    def _save(self, devices: dict[str, dict[str, Any]]) -> None:
        write_atomic(self.path, json.dumps({"version": VERSION, "devices": devices}, separators=(",", ":")),
                     fsync=False, what="warm-up budget")


def _valid(dev: dict[str, Any]) -> bool:
    """A device's entry as :meth:`WarmPool._save` writes it (anything else is dropped)."""
    asks = dev.get("asks")
    return (isinstance(dev.get("tokens"), (int, float)) and isinstance(dev.get("at"), (int, float))
            and isinstance(asks, dict)
            and all(isinstance(a, dict) and all(isinstance(a.get(k), (int, float)) for k in ("want", "priority", "at"))
                    for a in asks.values()))


def _budget(dev: dict[str, Any]) -> DeviceBudget:
    """A device's entry of the file as the pure budget (owners apart)."""
    asks = {k: WarmAsk(int(a["want"]), float(a["priority"]), float(a["at"])) for k, a in dev["asks"].items()}
    return DeviceBudget(float(dev["tokens"]), float(dev["at"]), asks)


def _owners(dev: dict[str, Any] | None) -> dict[str, str]:
    """Each ask's domain in a device's entry of the file (none for a device not in it)."""
    return {k: str(a.get("owner", "")) for k, a in (dev or {}).get("asks", {}).items()}


def _entry(dev: DeviceBudget, owners: dict[str, str]) -> dict[str, Any]:
    """The budget as the file keeps it, each ask with the domain that owns it."""
    return {"tokens": dev.tokens, "at": dev.at,
            "asks": {k: {"want": a.want, "priority": a.priority, "at": a.at, "owner": owners.get(k, "")}
                     for k, a in dev.asks.items()}}
