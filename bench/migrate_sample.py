"""Watching one migration run from this machine, once a second: the guest's requests, the devices, the set.

A :class:`Sampler` thread takes a sample a second from the moment the guest
starts on A until it is stopped: the guest's requests (libvirt's block
stats, rd_req + wr_req of vda, from A's libvirtd until B's resume event
came, from B's after it), both delay devices' counters (reads, read_bytes),
the bytes of the set resident through each host's own mount (cachestat:
each host's page cache), what each agent pins (its status file), and the
CPU seconds every program on this machine used since the last sample, by
host (bench/proc_cpu.py: on two cores a TCG guest gets what the rest leave).
bench/migrate_windows.py turns the samples into the run's figures.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import libvirt

from bench.e2e_host import delay_stats
from bench.proc_cpu import cpu_seconds, cpu_ticks
from tests.host.migration import Side, status
from tests.host.twohosts import mounts_from_env
from vmcache.host.cachestat import cachestat

PAGE = 4096
STEP = 1.0


def block_ios(side: Side, name: str) -> int | None:
    """Requests the guest made through vda on ``side``'s QEMU so far; None where the domain does not run there."""
    try:
        rd_req, _rd_bytes, wr_req, _wr_bytes, _errs = side.conn.lookupByName(name).blockStats("vda")
    except libvirt.libvirtError:
        return None
    return int(rd_req + wr_req)


class Sampler:
    """Samples of one run (see the module's docstring), taken in a thread of its own every ``STEP`` s."""

    def __init__(self, sides: tuple[Side, Side], name: str, image: str, ranges: list[tuple[int, int]],
                 stats: tuple[Path, Path]) -> None:
        self.sides, self.name, self.ranges, self.stats = sides, name, ranges, stats
        self.samples: list[dict[str, Any]] = []
        self.statuses: list[Any] = [None, None]   # each agent's last status seen (it goes with its domain)
        self._fds = [os.open(mount / image, os.O_RDONLY) for mount in mounts_from_env()]
        self._ns = {os.readlink(f"/proc/{side.host.leader}/ns/pid"): side.host.name for side in sides}
        self._cpu = cpu_ticks(self._ns)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sampler", daemon=True)

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def resumed(self) -> float | None:
        """When B's resume event of the domain came (None: not yet)."""
        return self.sides[1].event_time(self.name, libvirt.VIR_DOMAIN_EVENT_RESUMED,
                                        libvirt.VIR_DOMAIN_EVENT_RESUMED_MIGRATED)

    def take(self) -> dict[str, Any]:
        where = "a" if self.resumed() is None else "b"
        ios = block_ios(self.sides[0 if where == "a" else 1], self.name)
        counters = [delay_stats(p) for p in self.stats]
        pins = [status(side.host, self.name) for side in self.sides]
        self.statuses = [new or old for new, old in zip(pins, self.statuses)]
        cpu, self._cpu = self._cpu, cpu_ticks(self._ns)
        return {"cpu": {k: round(v, 2) for k, v in cpu_seconds(cpu, self._cpu).items() if v},
                "t": round(time.time(), 3), "where": where, "ios": ios,
                "reads": [c.get("reads", 0) for c in counters], "read_bytes": [c.get("read_bytes", 0) for c in counters],
                "set": [sum(cachestat(fd, start, length).nr_cache for start, length in self.ranges) * PAGE
                        for fd in self._fds],
                "pinned": [sum(d.get("pinned_bytes", 0) for d in s.get("disks", [])) if s else None for s in pins]}

    def _loop(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            self.samples.append(self.take())
            next_at += STEP
            self._stop.wait(max(0.0, next_at - time.monotonic()))

    def stop(self) -> list[dict[str, Any]]:
        """Stop sampling; the samples taken."""
        self._stop.set()
        self._thread.join(timeout=30)
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        return self.samples
