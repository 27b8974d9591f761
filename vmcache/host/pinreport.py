"""What one ``Pinner.apply`` did, and the regions that failed (vmcache.host.pinner)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from ..errors import PinError
from ..logfmt import event
from ..model.region import Region

__all__ = ["PinFailure", "PinReport"]


@dataclass(frozen=True)
class PinFailure:
    """A region that could not be pinned or released, and why."""

    start: int
    length: int
    op: str  # "mmap", "mlock", "munmap"
    errno: int


@dataclass(frozen=True)
class PinReport:
    """What one ``apply`` did. Byte counts are in image bytes (page rounded)."""

    pinned_bytes: int
    regions: tuple[Region, ...]
    locked_bytes: int = 0  # of the pinned bytes, the pages locked: all of them but where only the cached are
    added: tuple[Region, ...] = ()
    removed: tuple[Region, ...] = ()
    kept: int = 0
    skipped_for_budget: int = 0
    skipped_for_floor: int = 0
    released_for_pressure: int = 0
    under_floor: bool = False  # MemAvailable (or a cgroup's room) was under the floor: nothing new could be pinned
    failures: tuple[PinFailure, ...] = field(default=())

    def log(self, log: logging.Logger) -> None:
        """One ``pin.apply`` line: at INFO when something changed or failed, else at DEBUG."""
        changed = (self.added or self.removed or self.skipped_for_budget or self.skipped_for_floor
                   or self.released_for_pressure or self.failures)
        log.log(logging.INFO if changed else logging.DEBUG, event(
            "pin.apply", regions=len(self.regions), bytes=self.pinned_bytes, added=len(self.added),
            removed=len(self.removed), kept=self.kept, skipped_budget=self.skipped_for_budget,
            skipped_floor=self.skipped_for_floor, released_pressure=self.released_for_pressure,
            failures=len(self.failures)))

    def check(self, path: str) -> None:
        """Raise PinError carrying this report when some region of image ``path`` failed."""
        if not self.failures:
            return
        first = self.failures[0]
        error = PinError(
            f"{first.op} failed for {len(self.failures)} region(s), first at {first.start}+{first.length}: "
            f"{os.strerror(first.errno)}",
            path=path,
            errno=first.errno,
        )
        error.report = self  # type: ignore[attr-defined]
        raise error
