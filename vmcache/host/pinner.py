"""Pin regions of an image in the page cache: one read-only mmap + mlock each.

Each pinned region is its own ``MAP_SHARED``/``PROT_READ`` mapping of the
image, locked with mlock(2) - whole, or only the pages cached (``fill``
False: nothing is read from the device): one VMA per region (the count is bounded
by the plan's region count, far below ``vm.max_map_count``). Python never
touches the mapped memory, so a file truncated under a pin only loses the
pages past its new end; it never SIGBUSes. Releasing is munlock + munmap.

``Pinner.apply`` makes the pinned set equal to a plan, changing only the
difference, within a byte budget and a free-memory floor.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import PinError
from ..logfmt import event
from ..model import pindiff
from ..model.blocks import BlockValues
from ..model.pindiff import Span
from ..model.region import Region
from .cachestat import fd_size
from . import locking
from .meminfo import MemInfo, read_meminfo
from .pagerefs import PageRefs, read_evidence
from .pagecache import map_readonly, unmap
from .pinreport import PinFailure, PinReport

__all__ = ["Pinner", "PinReport", "PinFailure"]

_LOG = logging.getLogger(__name__)


@dataclass
class _Pin:
    region: Region
    addr: int
    locked: int  # bytes of the mapping locked: its length, or the cached pages when only those were
    apart: bool = False  # every page read in by the agent: charged to its memory cgroup, not QEMU's


class _Run:
    """What one ``apply`` has done so far: releases, additions, failures, the MemAvailable estimate."""

    def __init__(self, pinner: Pinner, available: int) -> None:
        self._pinner = pinner
        self.available = available
        self.added: list[Region] = []
        self.removed: list[Region] = []
        self.failures: list[PinFailure] = []
        self.released_for_pressure = 0

    def release(self, span: Span, reason: str) -> int:
        """Release pin ``span``; the bytes freed (0 when it failed: the failure is recorded)."""
        region = self._pinner._pins[span].region
        failure = self._pinner._release(span, reason)
        if failure:
            self.failures.append(failure)
            return 0
        self.removed.append(region)
        self.available += span[1]
        return span[1]


class Pinner:
    """Keeps a set of regions of one image locked in memory.

    ``floor_bytes``: never pin new bytes that would take MemAvailable under
    this, and release pins (lowest priority first) while it is under it.
    ``meminfo``: reads host memory (production default: /proc/meminfo).
    ``room``: the bytes the memory cgroups the pins are charged to can still
    take (:meth:`vmcache.host.memcg.MemcgRoom.room`; None from it: no limit;
    called with ``apart=True`` while every pin is charged to the agent),
    held to as the headroom above the floor is: a pin that would take a
    limited cgroup past it is skipped, and pins are released while it is
    negative, so QEMU's own memory never meets a limit that pins fill.
    ``apart``: whether QEMU is under a memory limit the agent is not
    (:meth:`vmcache.host.memcg.MemcgRoom.apart`); then ``apply(recharge=True)``
    and :meth:`recharge` drop a new pin's cached pages and read them again,
    so that they are charged to the agent, and a limit an operator lowers
    never meets pages it cannot reclaim.
    The image is opened read-only here and kept open until ``close``.
    Raises PinError when the image cannot be opened.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        floor_bytes: int,
        meminfo: Callable[[], MemInfo] = read_meminfo,
        room: Callable[..., int | None] | None = None,
        apart: Callable[[], bool] | None = None,
        logger: logging.Logger | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self.floor_bytes = int(floor_bytes)
        self._meminfo = meminfo
        self._room = room
        self._apart = apart
        self._log = logger or _LOG
        self._pins: dict[Span, _Pin] = {}
        try:
            self._fd: int | None = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as err:
            raise PinError(f"cannot open image: {os.strerror(err.errno or 0)}", path=self.path,
                           errno=err.errno) from err

    # -- state -----------------------------------------------------------

    @property
    def pinned(self) -> list[Region]:
        """The pinned regions, highest priority first."""
        return sorted((p.region for p in self._pins.values()), key=lambda r: (-r.priority, r.start))

    @property
    def pinned_bytes(self) -> int:
        return sum(length for _, length in self._pins)

    @property
    def locked_bytes(self) -> int:
        """Of :attr:`pinned_bytes`, the bytes locked as of the last lock (a pin that locks only what is
        cached holds fewer; the budget counts each pin whole all the same)."""
        return sum(pin.locked for pin in self._pins.values())

    def read_evidence(self, block_size: int, nblocks: int, refs: PageRefs, *, per_block: int = 16,
                      phase: int = 0) -> BlockValues:
        """For the pinned blocks, the fraction of their sampled pages read since ``refs`` was last cleared
        (:func:`vmcache.host.pagerefs.read_evidence`)."""
        mappings = [(start, length, pin.addr) for (start, length), pin in self._pins.items()]
        return read_evidence(mappings, block_size, nblocks, refs, per_block=per_block, phase=phase)

    # -- changes ---------------------------------------------------------

    def _pin(self, region: Region, held: Sequence[Span] = (), fill: bool = True,
             recharge: bool = False) -> PinFailure | None:
        """mmap and mlock ``region``; ``held``: pins still locked inside it (not read again).

        ``fill``: read what is not cached and lock all of it; else lock only
        what is cached (:func:`vmcache.host.locking.lock_cached`).
        ``recharge`` (with ``fill``): drop what is cached outside ``held``
        first, so that all of it is read in, and charged, by the agent.
        """
        assert self._fd is not None
        op = "mmap"
        try:
            addr = map_readonly(self._fd, region.start, region.length)
            op = "mlock"
            try:
                locking.no_readaround(addr, region.length)
                if fill:
                    for start, length in pindiff.uncovered(region, held):
                        locking.load_and_lock(self._fd, addr, region.start, start, length, dropped=recharge)
                locked = locking.lock(addr, region.length, fill)
            except OSError:
                unmap(addr, region.length)
                raise
        except OSError as err:
            self._log.warning(event("pin.fail", op=op, start=region.start, length=region.length, errno=err.errno))
            return PinFailure(region.start, region.length, op, err.errno or 0)
        apart = fill and recharge and all(self._pins[s].apart for s in held)  # held pages keep their charge
        self._pins[region.span] = _Pin(region, addr, locked, apart)
        self._log.info(event("pin.add", start=region.start, length=region.length, priority=f"{region.priority:g}"))
        return None

    def _unlock_outside(self, span: Span, keep: Region) -> None:
        """munlock the parts of pin ``span`` outside ``keep`` (the mapping stays until released).

        Before a reshaped pin's replacement is locked: the bytes locked at
        any moment stay within the union of the old and new plans' totals.
        """
        pin = self._pins[span]
        start, end = span[0], span[0] + span[1]
        for lo, hi in ((start, min(end, keep.start)), (max(start, keep.end), end)):
            if hi > lo:
                locking.munlock(pin.addr + lo - start, hi - lo)

    def _release(self, span: Span, reason: str) -> PinFailure | None:
        pin = self._pins[span]
        locking.munlock(pin.addr, span[1])  # munmap unlocks anyway
        try:
            unmap(pin.addr, span[1])
        except OSError as err:
            self._log.warning(event("pin.fail", op="munmap", start=span[0], length=span[1], errno=err.errno))
            return PinFailure(span[0], span[1], "munmap", err.errno or 0)
        del self._pins[span]
        self._log.info(event("pin.remove", start=span[0], length=span[1], reason=reason))
        return None

    def apply(self, regions: Sequence[Region], budget: int, *, fill: bool = True,
              recharge: bool = False) -> PinReport:
        """Make the pinned set equal to ``regions``, touching only the difference.

        Regions are taken by priority (highest first), clipped to the
        current file size; a region that does not fit the ``budget`` (bytes
        in total) is skipped and the next one tried, one that does not fit
        the headroom above the floor is pinned as far as it goes (its
        head). A planned region that overlaps pins of another extent (it
        grew, shrank or moved) replaces them: it is locked first (only its
        new bytes need headroom), then they are released; if it cannot be
        pinned they stay, at its priority. When MemAvailable is already
        under the floor nothing new is pinned and the lowest-priority pins
        are released (the last one only its tail, when that is enough)
        until the estimate (MemAvailable plus the bytes released) is back
        above it. What to do is decided by
        vmcache.model.pindiff; this method only carries it out. ``fill``
        False: new pins lock only the pages cached now (nothing is read from
        the device; :meth:`lock_cached` locks those cached later); the
        budget and the floor still count each pin whole. ``recharge`` (with
        ``fill``): new pins read all their pages in, cached or not, so that
        they are charged to the agent (see the class docstring).

        Raises PinError (with ``.report``) when some region could not be
        pinned or released; every other region is still applied and tracked.
        """
        if self._fd is None:
            raise PinError("pinner is closed", path=self.path)
        try:
            size = fd_size(self._fd)
        except OSError as err:
            raise PinError(f"fstat: {os.strerror(err.errno or 0)}", path=self.path, errno=err.errno) from err
        wanted = pindiff.clip(regions, size)
        available, limit = self._available(recharge and all(p.apart for p in self._pins.values()))
        run = _Run(self, available)
        pressure = run.available < self.floor_bytes
        stale, overlapping = pindiff.unplanned(self._regions(), wanted)
        for span in stale:
            run.release(span, "plan")
        headroom = 0 if pressure else max(0, run.available - self.floor_bytes)
        todo = pindiff.diff(self._regions(), wanted, overlapping, budget=budget, headroom=headroom)
        for span in todo.release:
            run.release(span, "budget")
        for span, region in todo.keep.items():
            self._pins[span].region = region  # priority may have changed
        if todo.skipped_floor:
            self._log.info(event("pin.skip", reason=limit, bytes=todo.skipped_floor, available=run.available,
                                 floor=self.floor_bytes))
        for addition in todo.add:
            self._add(addition, run, fill, recharge)
        for span in todo.orphans:
            if span in self._pins:
                run.release(span, "budget")
        if pressure:
            reason = "pressure" if limit == "floor" else limit
            for span in pindiff.pressure_order(self._regions().values()):
                if run.available >= self.floor_bytes:
                    break
                head = pindiff.shrunk(self._pins[span].region, self.floor_bytes - run.available)
                freed = self._shrink(span, head, run, reason, fill) if head else run.release(span, reason)
                run.released_for_pressure += freed
        return self._report(run, todo)

    def _shrink(self, span: Span, head: Region, run: _Run, reason: str, fill: bool) -> int:
        """Keep only ``head`` of pin ``span`` locked, give back the rest for ``reason``; the bytes freed.

        The head is mapped and locked again (its pages are locked already:
        nothing is read) before the old mapping goes; if that fails the
        whole pin goes.
        """
        self._unlock_outside(span, head)
        failure = self._pin(head, (span,), fill, self._pins[span].apart)
        if failure:
            run.failures.append(failure)
            return run.release(span, reason)
        if not run.release(span, reason):
            return 0
        run.added.append(head)
        run.available -= head.length
        return span[1] - head.length

    def _available(self, apart: bool = False) -> tuple[int, str]:
        """MemAvailable, or less where a limited cgroup leaves less room above the floor; and which one limits.

        ``apart``: every pin is, and every new one will be, charged to the agent.
        """
        host = self._meminfo().available_bytes
        room = None if self._room is None else self._room(apart=True) if apart else self._room()
        if room is not None and room + self.floor_bytes < host:
            return room + self.floor_bytes, "cgroup"
        return host, "floor"

    def lock_cached(self) -> list[PinFailure]:
        """Lock the pages cached in the pins since they were locked by ``apply(fill=False)``; the failures.

        Those are the guest's reads (or another reader's of the image, such
        as a backup's), and the read evidence (:meth:`read_evidence`) sees
        them once they are locked.
        A pin whose lock fails stays as it was.
        """
        failures = []
        for span, pin in self._pins.items():
            try:
                pin.locked = locking.lock_cached(pin.addr, span[1])
            except OSError as err:
                self._log.warning(event("pin.fail", op="mlock", start=span[0], length=span[1], errno=err.errno))
                failures.append(PinFailure(span[0], span[1], "mlock", err.errno or 0))
        return failures

    @property
    def agent_charged_bytes(self) -> int:
        """Of :attr:`pinned_bytes`, those the agent read in itself (:meth:`recharge`): charged to it."""
        return sum(span[1] for span, pin in self._pins.items() if pin.apart)

    def charges_apart(self) -> bool:
        """Whether QEMU is under a memory limit the agent is not (False where nobody said)."""
        return self._apart is not None and self._apart()

    def recharge(self, allowance: int | None) -> list[PinFailure]:
        """Read pins that hold pages charged to QEMU in again, charged to the agent; the failures.

        Highest priority first, until ``allowance`` bytes (None: all; at
        least one pin a call, so that one larger than the allowance still
        moves). Each is released, its pages dropped, and loaded and locked
        whole again: the guest misses them for the time of that read. A pin
        that cannot be locked again is gone; the next plan pins it anew.
        """
        failures: list[PinFailure] = []
        done = 0
        for span, pin in sorted(self._pins.items(), key=lambda kv: (-kv[1].region.priority, kv[0])):
            if pin.apart:
                continue
            if allowance is not None and done and done + span[1] > allowance:
                break
            failure = self._release(span, "recharge") or self._pin(pin.region, (), True, True)
            if failure:
                failures.append(failure)
            done += span[1]
        if done:
            self._log.info(event("pin.recharge", bytes=done, failures=len(failures)))
        return failures

    def _regions(self) -> dict[Span, Region]:
        return {span: pin.region for span, pin in self._pins.items()}

    def _add(self, addition: pindiff.Addition, run: _Run, fill: bool, recharge: bool) -> None:
        """Lock a new region; the pins it replaces go once it holds their pages, or are locked again."""
        region, old = addition.region, addition.replaces
        for span in old:
            self._unlock_outside(span, region)
        failure = self._pin(region, old, fill, recharge)
        if failure:
            run.failures.append(failure)
            for span in old:
                pin = self._pins[span]
                try:
                    pin.locked = locking.lock(pin.addr, span[1], fill)
                except OSError:
                    run.release(span, "reshape")
            return
        run.added.append(region)
        for span in old:
            run.release(span, "reshape")

    def _report(self, run: _Run, todo: pindiff.PinDiff) -> PinReport:
        """The report of one ``apply``, logged; raises PinError carrying it when something failed."""
        report = PinReport(
            pinned_bytes=self.pinned_bytes,
            regions=tuple(self.pinned),
            locked_bytes=self.locked_bytes,
            added=tuple(run.added),
            removed=tuple(run.removed),
            kept=todo.kept,
            skipped_for_budget=todo.skipped_budget,
            skipped_for_floor=todo.skipped_floor,
            released_for_pressure=run.released_for_pressure,
            failures=tuple(run.failures),
        )
        report.log(self._log)
        report.check(self.path)
        return report

    def release_all(self) -> None:
        """Unpin everything. Raises PinError if some mapping could not be removed (it stays tracked)."""
        failures = [f for span in list(self._pins) if (f := self._release(span, "release")) is not None]
        if failures:
            raise PinError(f"munmap failed for {len(failures)} region(s)", path=self.path, errno=failures[0].errno)

    def close(self) -> None:
        """Release every pin and close the image. Raises PinError like ``release_all``."""
        try:
            self.release_all()
        finally:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> Pinner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

