"""What to lock, unlock and keep to move a pinned set to a plan (pure).

:class:`~vmcache.host.pinner.Pinner` executes what these functions decide;
they only compute, on spans ``(start, length)`` of image bytes:

- :func:`clip`: the planned regions page aligned and cut to the file size,
  highest priority first, one per span.
- :func:`unplanned`: the pins that overlap nothing in the plan (released
  first: their bytes count as freed), and for each new planned region the
  pins of another extent it overlaps (it grew, shrank or moved). Those are
  *reshaped*: they stay locked until their replacement is, so the shared
  pages are never unlocked in between and only the new bytes need headroom.
- :func:`diff`: the walk of the plan by priority - keep a pin, add a region
  (replacing what it overlaps), or skip it for the budget or the headroom
  above the free-memory floor; a region larger than the headroom is pinned
  as far as it goes (its head), the rest waits for room; a reshaped pin
  whose replacement does not fit the headroom stays, at the new priority,
  within the budget.
- :func:`pressure_order`: the order pins are given back in while memory is
  under the floor (lowest priority first); :func:`shrunk`: the head of a pin
  to keep when giving back all of it would free more than is needed.
- :func:`uncovered`: the parts of a new region its replaced pins do not
  hold (what must be read from the device; a region grown chunk by chunk
  reads only its new chunk).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from .params import PAGE_SIZE
from .region import Region

__all__ = ["Span", "Addition", "PinDiff", "TRIM_MIN", "clip", "unplanned", "diff", "pressure_order", "shrunk",
           "uncovered"]

Span = tuple[int, int]
"""(start, length) in image-file bytes."""

TRIM_MIN = 4 << 20
"""Bytes a cut pin adds or gives back at least, and the room it leaves.

One hot zone is one region: under a memory cgroup's tight room it would
otherwise be pinned whole or not at all. A head grows only by this much
(into at least twice as much room) and a shrink leaves this much room, so
a room that wavers by less does not lock and unlock the pin cycle after
cycle.
"""


@dataclass(frozen=True)
class Addition:
    """A region to lock, and the pins it replaces (released once it holds their pages)."""

    region: Region
    replaces: tuple[Span, ...] = ()


@dataclass
class PinDiff:
    """One walk of the plan: what to keep, release, add; what did not fit."""

    keep: dict[Span, Region] = field(default_factory=dict)
    """Pins that stay, with their region at the plan's priority."""
    release: list[Span] = field(default_factory=list)
    """Pins in the plan that no longer fit the budget (released before any addition)."""
    add: list[Addition] = field(default_factory=list)
    orphans: list[Span] = field(default_factory=list)
    """Reshaped pins that nothing kept or replaced (released after the additions, for the budget)."""
    skipped_budget: int = 0
    skipped_floor: int = 0

    @property
    def kept(self) -> int:
        return len(self.keep)


def clip(regions: Iterable[Region], size: int) -> list[Region]:
    """Regions page aligned and cut to the file size ``size``, highest priority first, one per span."""
    out: dict[Span, Region] = {}
    file_end = -(-size // PAGE_SIZE) * PAGE_SIZE
    for region in sorted(regions, key=lambda r: -r.priority):
        start = region.start // PAGE_SIZE * PAGE_SIZE
        end = min(-(-region.end // PAGE_SIZE) * PAGE_SIZE, file_end)
        if end > start and (start, end - start) not in out:
            out[(start, end - start)] = Region(start, end - start, region.priority)
    return list(out.values())


def unplanned(pins: Mapping[Span, Region], wanted: Sequence[Region]) -> tuple[list[Span], dict[Span, list[Span]]]:
    """The pins that overlap nothing planned, and per new planned span the pins of another extent it overlaps."""
    wanted_spans = {r.span for r in wanted}
    overlapping: dict[Span, list[Span]] = {}
    for region in wanted:
        if region.span not in pins:
            overlapping[region.span] = [s for s, pin in pins.items() if s not in wanted_spans and pin.overlap(region)]
    reshaped = {s for spans in overlapping.values() for s in spans}
    return [s for s in pins if s not in wanted_spans and s not in reshaped], overlapping


def diff(pins: Mapping[Span, Region], wanted: Sequence[Region], overlapping: Mapping[Span, list[Span]], *,
         budget: int, headroom: int) -> PinDiff:
    """Walk ``wanted`` (highest priority first) against ``pins``, within ``budget`` bytes and ``headroom``.

    ``pins``: the pinned regions by span, after :func:`unplanned`'s were
    released; ``overlapping``: from :func:`unplanned`; ``headroom``: bytes
    that may be newly locked (MemAvailable above the floor, 0 under it).
    """
    out = PinDiff()
    total = 0
    claimed: set[Span] = set()
    for region in wanted:
        if region.span in pins:
            if total + region.length > budget:
                out.skipped_budget += region.length
                out.release.append(region.span)
            else:
                out.keep[region.span] = region
                total += region.length
            continue
        old = [s for s in overlapping[region.span] if s not in claimed]
        if total + region.length > budget:
            out.skipped_budget += region.length
            continue
        held = [pins[s] for s in old]
        head = region if _new_bytes(region, held) <= headroom else _head(region, held, headroom)
        if head is not None:
            # a head replaces only the pins inside it; the rest of the old pins stay locked below
            inside = tuple(old) if head is region else tuple(
                s for s in old if head.start <= s[0] and s[0] + s[1] <= head.end)
            out.add.append(Addition(head, inside))
            claimed.update(inside)
            headroom -= _new_bytes(head, held)
            total += head.length
            out.skipped_floor += region.length - head.length
            old = [s for s in old if s not in inside]
        else:
            out.skipped_floor += region.length
        for span in old:  # keep what is already locked of it, within the budget, at the new priority
            if total + span[1] <= budget:
                out.keep[span] = Region(span[0], span[1], region.priority)
                claimed.add(span)
                total += span[1]
    reshaped = {s for spans in overlapping.values() for s in spans}
    out.orphans = [s for s in reshaped if s not in claimed]
    return out


def _new_bytes(region: Region, held: Sequence[Region]) -> int:
    """Bytes of ``region`` no pin in ``held`` locks: what locking it takes from the headroom."""
    return region.length - sum(r.overlap(region) for r in held)


def _head(region: Region, held: Sequence[Region], headroom: int) -> Region | None:
    """The longest page-aligned head of ``region`` that leaves TRIM_MIN of ``headroom``; None if it adds less.

    ``held``: the pins it overlaps (their bytes need no headroom).
    """
    room = headroom - TRIM_MIN
    length = min(region.length, room + sum(r.overlap(region) for r in held)) // PAGE_SIZE * PAGE_SIZE
    while length > 0:
        excess = _new_bytes(Region(region.start, length, region.priority), held) - room
        if excess <= 0:
            break
        length = (length - excess) // PAGE_SIZE * PAGE_SIZE
    if length <= 0:
        return None
    head = Region(region.start, length, region.priority)
    return head if _new_bytes(head, held) >= TRIM_MIN else None


def shrunk(region: Region, need: int) -> Region | None:
    """The head of pin ``region`` left when its tail gives back ``need`` bytes and TRIM_MIN more (whole pages);
    None when that leaves less than TRIM_MIN."""
    length = (region.length - -(-(need + TRIM_MIN) // PAGE_SIZE) * PAGE_SIZE) // PAGE_SIZE * PAGE_SIZE
    return Region(region.start, length, region.priority) if length >= TRIM_MIN else None


def pressure_order(pins: Iterable[Region]) -> list[Span]:
    """Spans in the order they are given back under memory pressure: lowest priority, then highest offset."""
    return [r.span for r in sorted(pins, key=lambda r: (r.priority, -r.start))]


def uncovered(region: Region, held: Iterable[Span]) -> list[Span]:
    """The spans of ``region`` that none of ``held`` covers, in offset order."""
    out: list[Span] = []
    pos = region.start
    for start, length in sorted(held):
        if start > pos:
            out.append((pos, min(start, region.end) - pos))
        pos = max(pos, start + length)
        if pos >= region.end:
            break
    if pos < region.end:
        out.append((pos, region.end - pos))
    return [span for span in out if span[1] > 0]
