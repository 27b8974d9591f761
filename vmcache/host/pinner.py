"""Reach a plan: make an image's pinned set equal to the planned regions, within budget and headroom.

``Pinner.apply`` changes only the difference, within a byte budget and a
free-memory floor (or a limited memory cgroup's room); what to change is
decided by vmcache.model.pindiff, the mappings and their locks are
:class:`vmcache.host.pintable.PinTable`'s. ``Pinner.recharge`` moves pins
charged to QEMU's memory cgroup over to the agent's.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence

from ..logfmt import event
from ..model import pindiff
from ..model.blocks import BlockValues
from ..model.pindiff import Span
from ..model.region import Region
from .meminfo import MemInfo, read_meminfo
from .pagerefs import PageRefs
from .pinreport import PinFailure, PinReport
from .pintable import PinTable

__all__ = ["Pinner", "PinReport", "PinFailure"]

_LOG = logging.getLogger(__name__)


class _Run:
    """What one ``apply`` has done so far: releases, additions, failures, the MemAvailable estimate."""

    def __init__(self, table: PinTable, available: int) -> None:
        self._table = table
        self.available = available
        self.added: list[Region] = []
        self.removed: list[Region] = []
        self.failures: list[PinFailure] = []
        self.released_for_pressure = 0
        self.under_floor = False

    def release(self, span: Span, reason: str) -> int:
        """Release pin ``span``; the bytes freed (0 when it failed: the failure is recorded)."""
        region = self._table.region(span)
        failure = self._table.release(span, reason)
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
        self._table = PinTable(self.path, self._log)

    # -- state -----------------------------------------------------------

    @property
    def pinned(self) -> list[Region]:
        """The pinned regions, highest priority first."""
        return self._table.pinned

    @property
    def pinned_bytes(self) -> int:
        return self._table.pinned_bytes

    @property
    def locked_bytes(self) -> int:
        """Of :attr:`pinned_bytes`, the bytes locked as of the last lock (a pin that locks only what is
        cached holds fewer; the budget counts each pin whole all the same)."""
        return self._table.locked_bytes

    @property
    def agent_charged_bytes(self) -> int:
        """Of :attr:`pinned_bytes`, those the agent read in itself (:meth:`recharge`): charged to it."""
        return self._table.agent_charged_bytes

    def read_evidence(self, block_size: int, nblocks: int, refs: PageRefs, *, per_block: int = 16,
                      phase: int = 0) -> BlockValues:
        """For the pinned blocks, the fraction of their sampled pages read since ``refs`` was last cleared
        (:func:`vmcache.host.pagerefs.read_evidence`)."""
        return self._table.read_evidence(block_size, nblocks, refs, per_block=per_block, phase=phase)

    # -- changes ---------------------------------------------------------

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
        wanted = pindiff.clip(regions, self._table.size())
        available, limit = self._available(recharge and self._table.apart())
        run = _Run(self._table, available)
        run.under_floor = run.available < self.floor_bytes
        stale, overlapping = pindiff.unplanned(self._table.regions(), wanted)
        for span in stale:
            run.release(span, "plan")
        headroom = 0 if run.under_floor else max(0, run.available - self.floor_bytes)
        todo = pindiff.diff(self._table.regions(), wanted, overlapping, budget=budget, headroom=headroom)
        for span in todo.release:
            run.release(span, "budget")
        for span, region in todo.keep.items():
            self._table.set_priority(span, region)
        if todo.skipped_floor:
            self._log.info(event("pin.skip", reason=limit, bytes=todo.skipped_floor, available=run.available,
                                 floor=self.floor_bytes))
        for addition in todo.add:
            self._add(addition, run, fill, recharge)
        for span in todo.orphans:
            if span in self._table:
                run.release(span, "budget")
        if run.under_floor:
            self._relieve(run, "pressure" if limit == "floor" else limit, fill)
        return self._report(run, todo)

    def _relieve(self, run: _Run, reason: str, fill: bool) -> None:
        """Release the lowest-priority pins (the last one only its tail, when that is enough) until the
        MemAvailable estimate is back above the floor."""
        for span in pindiff.pressure_order(self._table.regions().values()):
            if run.available >= self.floor_bytes:
                break
            head = pindiff.shrunk(self._table.region(span), self.floor_bytes - run.available)
            run.released_for_pressure += self._shrink(span, head, run, reason, fill) if head else run.release(
                span, reason)

    def _shrink(self, span: Span, head: Region, run: _Run, reason: str, fill: bool) -> int:
        """Keep only ``head`` of pin ``span`` locked, give back the rest for ``reason``; the bytes freed.

        The head is mapped and locked again (its pages are locked already:
        nothing is read) before the old mapping goes; if that fails the
        whole pin goes.
        """
        self._table.unlock_outside(span, head)
        failure = self._table.pin(head, (span,), fill, self._table.apart((span,)))
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
        return self._table.lock_cached()

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
        for span, region, apart in self._table.by_priority():
            if apart:
                continue
            if allowance is not None and done and done + span[1] > allowance:
                break
            failure = self._table.release(span, "recharge") or self._table.pin(region, (), True, True)
            if failure:
                failures.append(failure)
            done += span[1]
        if done:
            self._log.info(event("pin.recharge", bytes=done, failures=len(failures)))
        return failures

    def _add(self, addition: pindiff.Addition, run: _Run, fill: bool, recharge: bool) -> None:
        """Lock a new region; the pins it replaces go once it holds their pages, or are locked again."""
        region, old = addition.region, addition.replaces
        if len(old) == 1 and not recharge and self._table.trim(old[0], region):
            return
        old = tuple(span for span in old if span in self._table)  # a failed trim released its pin
        for span in old:
            self._table.unlock_outside(span, region)
        failure = self._table.pin(region, old, fill, recharge)
        if failure:
            run.failures.append(failure)
            for span in old:
                if not self._table.relock(span, fill):
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
            under_floor=run.under_floor,
            failures=tuple(run.failures),
        )
        report.log(self._log)
        report.check(self.path)
        return report

    def release_all(self) -> None:
        """Unpin everything. Raises PinError if some mapping could not be removed (it stays tracked)."""
        self._table.release_all()

    def close(self) -> None:
        """Release every pin and close the image. Raises PinError like ``release_all``."""
        self._table.close()

    def __enter__(self) -> Pinner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

