"""The pins one image holds: each a read-only mmap of a region, locked whole or in its cached pages.

Each pinned region is its own ``MAP_SHARED``/``PROT_READ`` mapping of the
image, locked with mlock(2) - whole, or only the pages cached (``fill``
False: nothing is read from the device): one VMA per region (the count is bounded
by the plan's region count, far below ``vm.max_map_count``). Python never
touches the mapped memory, so a file truncated under a pin only loses the
pages past its new end; it never SIGBUSes. Releasing is munlock + munmap.

This keeps the mappings and their locks; which regions to hold, within
what, is :class:`vmcache.host.pinner.Pinner`'s (and vmcache.model.pindiff's).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import PinError
from ..logfmt import event
from ..model import pindiff
from ..model.blocks import BlockValues
from ..model.pindiff import Span
from ..model.region import Region
from . import locking
from .cachestat import fd_size
from .pagecache import map_readonly, unmap
from .pagerefs import PageRefs, read_evidence
from .pinreport import PinFailure

__all__ = ["PinTable"]


@dataclass
class _Pin:
    region: Region
    addr: int
    locked: int  # bytes of the mapping locked: its length, or the cached pages when only those were
    apart: bool = False  # every page read in by the agent: charged to its memory cgroup, not QEMU's


class PinTable:
    """The pinned mappings of the image at ``path``, by span; opened read-only here, kept open until ``close``.

    Raises PinError when the image cannot be opened.
    """

    def __init__(self, path: str, logger: logging.Logger) -> None:
        self.path = path
        self._log = logger
        self._pins: dict[Span, _Pin] = {}
        try:
            self._fd: int | None = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as err:
            raise PinError(f"cannot open image: {os.strerror(err.errno or 0)}", path=self.path,
                           errno=err.errno) from err

    # -- what is held ----------------------------------------------------

    @property
    def pinned(self) -> list[Region]:
        """The pinned regions, highest priority first."""
        return sorted((p.region for p in self._pins.values()), key=lambda r: (-r.priority, r.start))

    @property
    def pinned_bytes(self) -> int:
        return sum(length for _, length in self._pins)

    @property
    def locked_bytes(self) -> int:
        return sum(pin.locked for pin in self._pins.values())

    @property
    def agent_charged_bytes(self) -> int:
        return sum(span[1] for span, pin in self._pins.items() if pin.apart)

    def __contains__(self, span: Span) -> bool:
        return span in self._pins

    def regions(self) -> dict[Span, Region]:
        return {span: pin.region for span, pin in self._pins.items()}

    def region(self, span: Span) -> Region:
        return self._pins[span].region

    def set_priority(self, span: Span, region: Region) -> None:
        """Pin ``span`` now stands for ``region`` (the same bytes; its priority may have changed)."""
        self._pins[span].region = region

    def apart(self, spans: Sequence[Span] | None = None) -> bool:
        """Whether all of ``spans`` (None: every pin) were read in by the agent, charged to it."""
        return all(self._pins[s].apart for s in (self._pins if spans is None else spans))

    def by_priority(self) -> list[tuple[Span, Region, bool]]:
        """Every pin as (span, region, apart), highest priority first."""
        return [(span, pin.region, pin.apart)
                for span, pin in sorted(self._pins.items(), key=lambda kv: (-kv[1].region.priority, kv[0]))]

    def size(self) -> int:
        """The image file's size now. Raises PinError (also once closed)."""
        if self._fd is None:
            raise PinError("pinner is closed", path=self.path)
        try:
            return fd_size(self._fd)
        except OSError as err:
            raise PinError(f"fstat: {os.strerror(err.errno or 0)}", path=self.path, errno=err.errno) from err

    def read_evidence(self, block_size: int, nblocks: int, refs: PageRefs, *, per_block: int = 16,
                      phase: int = 0) -> BlockValues:
        """For the pinned blocks, the fraction of their sampled pages read since ``refs`` was last cleared
        (:func:`vmcache.host.pagerefs.read_evidence`)."""
        mappings = [(start, length, pin.addr) for (start, length), pin in self._pins.items()]
        return read_evidence(mappings, block_size, nblocks, refs, per_block=per_block, phase=phase)

    # -- changes ---------------------------------------------------------

    def pin(self, region: Region, held: Sequence[Span] = (), fill: bool = True,
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
        apart = fill and recharge and self.apart(held)  # held pages keep their charge
        self._pins[region.span] = _Pin(region, addr, locked, apart)
        self._log.info(event("pin.add", start=region.start, length=region.length, priority=f"{region.priority:g}"))
        return None

    def unlock_outside(self, span: Span, keep: Region) -> None:
        """munlock the parts of pin ``span`` outside ``keep`` (the mapping stays until released).

        Before a reshaped pin's replacement is locked: the bytes locked at
        any moment stay within the union of the old and new plans' totals.
        """
        pin = self._pins[span]
        start, end = span[0], span[0] + span[1]
        for lo, hi in ((start, min(end, keep.start)), (max(start, keep.end), end)):
            if hi > lo:
                locking.munlock(pin.addr + lo - start, hi - lo)

    def trim(self, span: Span, region: Region) -> bool:
        """Cut pin ``span`` down to ``region`` inside it: only the cut pages are unmapped (so unlocked), the
        rest stays mapped and locked - locking a zone anew each time the plan trims it by a few MiB walks
        all its pages twice. False where it cannot be (not inside, or locked only in part): the pin as it
        was; or where an unmap failed: the pin released (the caller pins ``region`` anew)."""
        pin = self._pins[span]
        start, end = span[0], span[0] + span[1]
        if region.span == span or not start <= region.start < region.end <= end or pin.locked != span[1]:
            return False
        try:
            for lo, hi in ((region.end, end), (start, region.start)):
                if hi > lo:
                    unmap(pin.addr + lo - start, hi - lo)
        except OSError as err:  # munmap of the whole span still removes what is left of it
            self._log.warning(event("pin.fail", op="munmap", start=start, length=span[1], errno=err.errno))
            self.release(span, "trim")
            return False
        del self._pins[span]
        self._pins[region.span] = _Pin(region, pin.addr + region.start - start, region.length, pin.apart)
        self._log.info(event("pin.trim", start=region.start, length=region.length, was=f"{span[0]}+{span[1]}"))
        return True

    def relock(self, span: Span, fill: bool) -> bool:
        """Lock pin ``span`` again as it was (after its replacement failed); False when that failed."""
        pin = self._pins[span]
        try:
            pin.locked = locking.lock(pin.addr, span[1], fill)
        except OSError:
            return False
        return True

    def release(self, span: Span, reason: str) -> PinFailure | None:
        """munlock and munmap pin ``span``; the failure when the mapping could not be removed (it stays)."""
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

    def lock_cached(self) -> list[PinFailure]:
        """Lock the pages cached in the pins since they were locked (``fill`` False); the failures.

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

    def release_all(self) -> None:
        """Unpin everything. Raises PinError if some mapping could not be removed (it stays tracked)."""
        failures = [f for span in list(self._pins) if (f := self.release(span, "release")) is not None]
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
