"""Dividing the host's pinned-bytes cap between VMs by benefit (pure).

Every agent publishes, per domain, a *demand curve*: cumulative bytes ->
cumulative benefit of pinning them, built from its plan at the full
metadata budget (:func:`demand_curve`). :func:`split` divides the cap by
marginal benefit: the bytes with the highest benefit per byte across all
curves are granted first (water-filling), each domain within its budget,
after every domain got its guaranteed minimum.

Benefit per byte is comparable between VMs: a region's benefit density is
the mean *raw* heat of its blocks (not the planner's priority, which sums
heat per block and carries the planner's ``keep_factor``), divided by the
model's ``read_amplitude`` (or ``write_amplitude`` when reads weigh 0).
Heat is a time-weighted mean of the block's resident fraction (and written
fraction times its amplitude) with a time constant given in seconds
(``decay`` per reference ``interval``, applied as ``decay ** (dt/interval)``),
so the density is the share of the region's bytes the guest keeps using:
the same figure for a 64 KiB or a 1 MiB block size, a 5 s or a 30 s cycle, a
10 GiB or a 2 TiB disk. 1.0 is a fully resident, continually read range.

Hysteresis: bytes a domain was granted last time count ``keep`` times their
benefit (an incumbent must be beaten by that factor), and a domain's grant
moves only when the new split moves it by more than ``quantum`` bytes (or
1/32 of its budget, whichever is less), so grants do not flap between
near-equal curves.

Domains without a curve (agents of an older vmcache in the ledger) keep
what they hold: it comes off the cap before the split (``fixed``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..units import format_size
from .params import PAGE_SIZE, ModelParams
from .region import Region

if TYPE_CHECKING:  # numpy loads in demand_curve only: the ledger and `vmcache status` split without it
    from numpy.typing import ArrayLike

    from .heat import ActiveHeat

__all__ = ["Curve", "Demand", "Split", "MAX_POINTS", "demand_curve", "demand_of", "merge_curves", "split",
           "split_budget"]

Curve = tuple[tuple[int, float], ...]
"""Cumulative ``(bytes, benefit)`` points, bytes rising, benefit per byte falling; (0, 0) implied."""

MAX_POINTS = 32
"""Most points a published curve keeps (the ledger entry stays small)."""

DEFAULT_KEEP = 1.25
"""Benefit factor of the bytes a domain holds now (hysteresis)."""


@dataclass(frozen=True)
class Demand:
    """What one domain asks of the cap: an upper ``budget``, a guaranteed ``minimum``, a curve.

    ``granted``: its grant of the previous split (hysteresis; 0 for a newcomer).
    """

    budget: int
    minimum: int = 0
    curve: Curve = ()
    granted: int = 0

    @property
    def demand_bytes(self) -> int:
        """Bytes the curve asks for (never above the budget)."""
        return min(self.budget, self.curve[-1][0]) if self.curve else 0


@dataclass(frozen=True)
class Split:
    """The result: bytes granted per domain, and what constrained it."""

    grants: dict[str, int]
    cap: int | None
    fixed: int = 0                  # held by domains without a curve (older agents)
    minimums: int = 0               # guaranteed bytes handed out first
    error: str | None = None        # e.g. the minimums exceed the cap (they were scaled down)
    densities: dict[str, float] = field(default_factory=dict)  # benefit per byte at each grant's margin


def demand_curve(regions: Iterable[Region], blocks: ArrayLike, heat: ArrayLike, params: ModelParams, *,
                 points: int = MAX_POINTS) -> Curve:
    """The curve of ``regions`` (a plan at the full budget) under the heat of sorted ``blocks``.

    ``blocks``/``heat``: the blocks that have heat and theirs
    (``HeatModel.active``); other blocks have none.

    Each region's benefit is its bytes times its mean raw heat over the
    read amplitude (see the module docstring); regions are taken densest
    first, and the curve is cut to at most ``points`` points by merging
    neighbours of equal byte share (merging keeps densities falling).
    Raises ValueError for ``points`` under 1.
    """
    import numpy as np

    if points < 1:
        raise ValueError(f"points must be at least 1, got {points}")
    where = np.asarray(blocks, dtype=np.int64)
    sums = np.zeros(where.size + 1)
    np.cumsum(np.asarray(heat, dtype=np.float64), out=sums[1:])
    bs = params.block_size
    unit = params.read_amplitude or params.write_amplitude
    segments: list[tuple[float, int]] = []
    for r in regions:
        if r.length <= 0:
            continue
        first, last = r.start // bs, -(-r.end // bs)
        lo, hi = np.searchsorted(where, (first, last))
        mean = (sums[hi] - sums[lo]) / (last - first)
        if mean > 0:
            segments.append((mean / unit, r.length))
    segments.sort(key=lambda s: -s[0])
    return _cut(segments, points)


def demand_of(active: ActiveHeat, params: ModelParams, *, size_bytes: int, budget: int,
              current: Iterable[Region] = ()) -> Curve:
    """One disk's demand curve: its plan at the full ``budget`` (the metadata's, not the grant), as a curve.

    ``active``: ``HeatModel.active`` after this cycle's step; ``current``:
    the regions pinned now (the planner's hysteresis). Raises ValueError as
    :func:`~vmcache.model.planner.plan_active` does.
    """
    from .planner import plan_active

    regions = plan_active(active, params=params, size_bytes=size_bytes, budget=budget, current=current)
    return demand_curve(regions, active.blocks, active.heat, params)


def _cut(segments: list[tuple[float, int]], points: int) -> Curve:
    """Cumulative points of ``(density, bytes)`` segments (densest first), at most ``points``."""
    total = sum(n for _, n in segments)
    if total == 0:
        return ()
    out: list[tuple[int, float]] = []
    done, benefit, group = 0, 0.0, 1
    for density, n in segments:
        done += n
        benefit += density * n
        # a point where the running bytes reach the next 1/points share of the total
        if done * points >= group * total or done == total:
            out.append((done, benefit))
            group = done * points // total + 1
    return tuple(out)


def merge_curves(curves: Iterable[Curve], *, points: int = MAX_POINTS) -> Curve:
    """One curve of several (a domain's disks): their segments, densest first, cut to ``points``."""
    segments = [s for c in curves for s in _segments_of(c)]
    segments.sort(key=lambda s: -s[0])
    return _cut(segments, points)


def _segments_of(curve: Curve) -> list[tuple[float, int]]:
    """``(density, bytes)`` of each step of a cumulative curve."""
    out, prev_b, prev_v = [], 0, 0.0
    for b, v in curve:
        if b > prev_b:
            out.append(((v - prev_v) / (b - prev_b), b - prev_b))
        prev_b, prev_v = b, v
    return out


def split(demands: Mapping[str, Demand], cap: int | None, *, fixed: int = 0, keep: float = DEFAULT_KEEP,
          quantum: int = 0) -> Split:
    """Divide ``cap`` (None: no cap) minus ``fixed`` between ``demands`` by marginal benefit.

    1. Minimums first (each at most the budget); when they add up to more
       than the cap they are scaled down pro rata and ``error`` says so.
    2. The rest goes to the curves' steps beyond each minimum, densest first
       (ties by domain name: the result is deterministic), bytes a domain
       was ``granted`` last time counting ``keep`` times their density; the
       last step taken may be cut. Nobody passes its budget.
    3. What no curve asks for is shared equally between domains below their
       budget (so a domain whose heat grows can pin at once).
    4. A grant within ``quantum`` bytes (and 1/32 of the domain's budget) of
       the previous one stays, when the total still fits.

    Raises ValueError for a negative cap, budget or minimum, or ``keep`` < 1.
    """
    if keep < 1.0:
        raise ValueError(f"keep must be at least 1, got {keep}")
    for name, d in demands.items():
        if d.budget < 0 or d.minimum < 0:
            raise ValueError(f"{name}: budget and minimum must not be negative")
    if cap is None:
        return Split({n: d.budget for n, d in demands.items()}, None, fixed)
    if cap < 0:
        raise ValueError(f"cap must not be negative, got {cap}")
    avail = max(0, cap - fixed)
    grants, used, error = _minimums(demands, avail)
    minimums = used
    left, margin = _water_fill(demands, grants, avail - used, keep)
    left = _share_rest(demands, grants, left)
    if quantum > 0:
        held = {n: d.granted if abs(grants[n] - d.granted) <= min(quantum, d.budget // 32) and d.granted <= d.budget
                else grants[n] for n, d in demands.items()}
        if sum(held.values()) <= avail:
            grants = held
    return Split(grants, cap, fixed, minimums, error, margin)


def _minimums(demands: Mapping[str, Demand], avail: int) -> tuple[dict[str, int], int, str | None]:
    wanted = {n: min(d.minimum, d.budget) for n, d in demands.items()}
    total = sum(wanted.values())
    if total <= avail:
        return wanted, total, None
    scaled = {n: m * avail // total for n, m in wanted.items()}
    error = (f"guaranteed minimums (min=) add up to {format_size(total)}, more than the {format_size(avail)} "
             f"of the pinned cap left for them: each was cut to {avail * 100 // max(total, 1)}%")
    return scaled, sum(scaled.values()), error


def _water_fill(demands: Mapping[str, Demand], grants: dict[str, int], left: int,
                keep: float) -> tuple[int, dict[str, float]]:
    """Give ``left`` bytes to the curves' steps beyond ``grants`` (the minimums), densest first, in place.

    Every step is cut at the domain's minimum (below it: granted already),
    at its previous grant (below it the density counts ``keep`` times) and
    at its budget. Steps are taken densest first (ties: domain name) until
    ``left`` runs out, the last one cut. Vectorised: 100 domains of 32
    points cost well under a millisecond. Returns what is left and the
    density at each served domain's margin.
    """
    import numpy as np

    names = sorted(demands)
    rows = [(i, b, v) for i, n in enumerate(names) for b, v in demands[n].curve]
    if not rows or left <= 0:
        return left, {}
    who = np.array([r[0] for r in rows], dtype=np.int64)
    hi = np.array([r[1] for r in rows], dtype=np.int64)
    cum = np.array([r[2] for r in rows], dtype=np.float64)
    first = np.r_[True, who[1:] != who[:-1]]
    lo = np.where(first, 0, np.r_[0, hi[:-1]])
    lo_v = np.where(first, 0.0, np.r_[0.0, cum[:-1]])
    density = np.where(hi > lo, (cum - lo_v) / np.maximum(hi - lo, 1), 0.0)
    base = np.array([grants[n] for n in names], dtype=np.int64)[who]
    held = np.array([demands[n].granted for n in names], dtype=np.int64)[who]
    top = np.array([demands[n].budget for n in names], dtype=np.int64)[who]
    # each step in two pieces: below the previous grant (kept: density * keep) and above it
    start = np.concatenate((np.maximum(lo, base), np.maximum(np.maximum(lo, held), base)))
    end = np.concatenate((np.minimum(np.minimum(hi, held), top), np.minimum(hi, top)))
    dens = np.concatenate((density * keep, density))
    owner = np.concatenate((who, who))
    size = end - start
    ok = size > 0
    start, size, dens, owner = start[ok], size[ok], dens[ok], owner[ok]
    order = np.lexsort((start, owner, -dens))
    size, dens, owner = size[order], dens[order], owner[order]
    before = np.cumsum(size) - size
    take = np.clip(left - before, 0, size)
    served = take > 0
    given = np.bincount(owner[served], weights=take[served], minlength=len(names))
    margin: dict[str, float] = {}
    for i in np.flatnonzero(given).tolist():
        grants[names[i]] += int(given[i])
        margin[names[i]] = float(dens[served & (owner == i)][-1])
    return left - int(take.sum()), margin


def _share_rest(demands: Mapping[str, Demand], grants: dict[str, int], left: int) -> int:
    """Share ``left`` equally between domains below their budget (water-filling); return what is left."""
    while left >= PAGE_SIZE:
        open_ = sorted(n for n, d in demands.items() if grants[n] < d.budget)
        if not open_:
            break
        each = max(PAGE_SIZE, left // len(open_) // PAGE_SIZE * PAGE_SIZE)  # whole pages: no "granted 1B"
        for name in open_:
            take = min(each, demands[name].budget - grants[name], left)
            grants[name] += take
            left -= take
            if left == 0:
                break
    return left


def split_budget(total: int, disks: Mapping[str, Demand]) -> dict[str, int]:
    """Divide a domain's grant between its disks by the same rule (no minimums, no hysteresis)."""
    plain = {n: Demand(budget=d.budget, curve=d.curve) for n, d in disks.items()}
    return split(plain, total, keep=1.0).grants
