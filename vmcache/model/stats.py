"""What one engine cycle of one disk did: the record metrics, status and logs read (pure)."""

from __future__ import annotations

from dataclasses import dataclass

from .extents import BitmapRead

__all__ = ["CycleStats"]


@dataclass(frozen=True)
class CycleStats:
    """Figures of one cycle for one disk.

    Byte counts are image-file bytes. ``*_bytes`` fields are levels at the
    end of the cycle; ``guest_*`` fields are what happened during it.
    """

    now: float                      # monotonic time the cycle ended
    duration_seconds: float         # wall time the cycle took
    size_bytes: int                 # image size
    budget_bytes: int               # this disk's budget in force
    pinned_bytes: int               # pinned by vmcache after the cycle (the budget counts each pin whole)
    pinned_regions: int
    resident_bytes: int             # image bytes in the page cache (ours included)
    guest_written_bytes: int        # dirty-bitmap bytes written this cycle (granularity-rounded)
    guest_read_miss_bytes: int      # bytes that appeared in the cache not by vmcache's hand
    recently_evicted_pages: int | None  # cachestat nr_recently_evicted (None without cachestat)
    bitmap_read: BitmapRead         # how the dirty-bitmap read went (NONE: no tracker)
    mem_available_bytes: int
    backing_off: bool               # floor/pressure kept vmcache from pinning what it planned
    skipped_for_floor_bytes: int = 0
    warm_restored_bytes: int = 0    # of a saved hot set, pinned since the agent started
    warm_total_bytes: int = 0       # bytes of the saved hot set this disk started from (0: cold start)
    locked_bytes: int | None = None  # of the pinned bytes, the locked pages (fewer under ``fill: cached``)
    agent_charged_bytes: int | None = None  # of the pinned bytes, those read in by the agent (host/pinner.py)
    error: str | None = None        # last error of this cycle, one line
