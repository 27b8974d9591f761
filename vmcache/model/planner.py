"""Heat per block -> regions to pin under a byte budget, bounded in number (pure).

:func:`plan` works in five vectorised steps (no Python loop over blocks):

1. Hysteresis: heat of blocks inside ``current`` (the regions pinned now) is
   multiplied by ``keep_factor``; "heat" below means this effective heat.
   A pinned region is thus released only when its heat falls below
   ``threshold / keep_factor``, and a newcomer must be that much hotter to
   take its place in the budget. Blocks outside ``current`` get no bonus, so
   hysteresis never grows a region.
2. Runs: maximal runs of blocks with heat > ``threshold``. With ``own``
   (``HeatModel.own``, the heat each block earned itself, with the same
   hysteresis), each run is cut back to its first and last block whose own
   heat is above the threshold: the margin the Gaussian warmed around hot
   blocks is not pinned (a run with no such block stays whole). Runs
   separated by at most ``merge_gap`` cold blocks are then merged (the gap
   is pinned too); runs shorter than ``min_region`` blocks are dropped.
3. Cap: while there are more than ``max_regions`` runs, neighbours are
   merged across the smallest gaps first, but only where the gap is no
   longer than the shorter of the two runs (the merged span stays at least
   half hot, so little budget goes to cold blocks); if that is not enough,
   the weakest runs are dropped. Priority = sum of heat over the region.
4. Budget: regions are taken by priority until the budget is used. A region
   larger than what is left is trimmed to the hottest window of whole blocks
   that fits (a remainder smaller than one block stays unused), so a big
   lukewarm region cannot starve the budget, nor a hot core be lost because
   its region is too big.
5. Bytes: ``start = block * block_size``; the end is clipped to the file size
   rounded up to a page (mlock works on pages; the last page of an unaligned
   file is partly past EOF but still mappable). Blocks past the file size
   are ignored.

The result is sorted by priority (highest first, then by offset); its total
length never exceeds ``budget`` (rounded down to a page) and its count never
exceeds ``max_regions``. ``Region.priority`` is the effective heat sum, so
the pinner's "release lowest priority first" agrees with this order.

:func:`plan_active` plans from the model's sparse form
(:attr:`HeatModel.active`: only the blocks with heat), at a cost that
follows those blocks, not the disk's size; :func:`plan` takes dense
per-block arrays and gives the same regions (blocks with no heat are never
hot and add exactly nothing to a prefix sum).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from numpy.typing import ArrayLike, NDArray

from .blocks import PrefixSums, runs
from .heat import ActiveHeat
from .params import PAGE_SIZE, ModelParams
from .region import Region

__all__ = ["plan", "plan_active"]

_Runs = tuple[NDArray[np.intp], NDArray[np.intp]]


def plan(
    heat: ArrayLike,
    *,
    params: ModelParams,
    size_bytes: int,
    budget: int,
    current: Iterable[Region] = (),
    own: ArrayLike | None = None,
) -> list[Region]:
    """Choose the regions to pin for one disk from dense per-block arrays (see the module docstring).

    ``heat``: heat per block (``HeatModel.heat``); ``size_bytes``: size of the
    image file; ``budget``: bytes that may be pinned for it; ``current``: the
    regions pinned now (hysteresis); ``own``: ``HeatModel.own``, to trim runs
    to the blocks hot on their own (step 2). Raises ValueError for a heat
    array that is not one-dimensional or a negative size or budget.
    """
    values = np.asarray(heat)
    if values.ndim != 1:
        raise ValueError(f"heat must be one-dimensional, got shape {values.shape}")
    nblocks = min(values.shape[0], -(-max(size_bytes, 0) // params.block_size))
    values = values[:nblocks]
    mine = None if own is None else np.asarray(own)[:nblocks]
    some = values != 0 if mine is None else (values != 0) | (mine != 0)
    blocks = np.flatnonzero(some).astype(np.int64)
    active = ActiveHeat(blocks, values[blocks].astype(np.float32),
                        (mine[blocks] if mine is not None else np.zeros(blocks.size)).astype(np.float32))
    return plan_active(active, params=params, size_bytes=size_bytes, budget=budget, current=current,
                       trim=own is not None)


def plan_active(
    active: ActiveHeat,
    *,
    params: ModelParams,
    size_bytes: int,
    budget: int,
    current: Iterable[Region] = (),
    trim: bool = True,
) -> list[Region]:
    """Choose the regions to pin from the blocks that have heat (``HeatModel.active``).

    Blocks past the file are ignored; ``trim``: cut runs to the blocks hot
    on their own (``active.own``). Raises ValueError for a negative size or
    budget.
    """
    if size_bytes < 0 or budget < 0:
        raise ValueError(f"size_bytes and budget must not be negative, got {size_bytes}, {budget}")
    bs = params.block_size
    budget = budget - budget % PAGE_SIZE
    file_end = -(-size_bytes // PAGE_SIZE) * PAGE_SIZE
    nblocks = -(-size_bytes // bs)
    if budget == 0 or nblocks == 0:
        return []
    upto = int(np.searchsorted(active.blocks, nblocks))
    blocks = np.asarray(active.blocks[:upto], dtype=np.int64)
    inside = _inside(current, blocks, params)
    eff = _effective_heat(active.heat[:upto], inside, params)

    starts, ends = runs(blocks[eff > params.threshold])
    if trim:
        own_eff = _effective_heat(active.own[:upto], inside, params)
        starts, ends = _trim_to_own(starts, ends, blocks[own_eff > params.threshold])
    starts, ends = _merge(starts, ends, (starts[1:] - ends[:-1]) > params.merge_gap)
    long_enough = (ends - starts) >= params.min_region
    starts, ends = starts[long_enough], ends[long_enough]
    if starts.size == 0:
        return []

    sums = PrefixSums(blocks, eff)
    starts, ends = _cap(starts, ends, sums, params.max_regions)
    priority = sums.at(ends) - sums.at(starts)
    order = np.lexsort((starts, -priority))
    return _fill_budget(starts[order], ends[order], priority[order], sums, bs, file_end, budget)


def _inside(current: Iterable[Region], blocks: NDArray[np.int64], params: ModelParams) -> NDArray[np.bool_] | None:
    """Which of ``blocks`` lie in a current region (None when there is no hysteresis to apply)."""
    if params.keep_factor == 1.0:
        return None
    bs = params.block_size
    spans = [(max(r.start // bs, 0), -(-r.end // bs)) for r in current if r.length > 0]
    if not spans:
        return np.zeros(blocks.size, dtype=bool)
    firsts = np.sort(np.array([s for s, _ in spans], dtype=np.int64))
    ends = np.sort(np.array([e for _, e in spans], dtype=np.int64))
    # regions begun minus regions ended at each block: > 0 inside one
    return (np.searchsorted(firsts, blocks, side="right") - np.searchsorted(ends, blocks, side="right")) > 0


def _effective_heat(heat: NDArray[np.generic], inside: NDArray[np.bool_] | None,
                    params: ModelParams) -> NDArray[np.float32]:
    """Heat as float32, times ``keep_factor`` on the blocks ``inside`` the current regions."""
    eff = heat.astype(np.float32, copy=True)
    if inside is not None:
        np.multiply(eff, np.float32(params.keep_factor), out=eff, where=inside)
    return eff


def _trim_to_own(starts: NDArray[np.intp], ends: NDArray[np.intp], where: NDArray[np.int64]) -> _Runs:
    """Cut each run back to its first and last block hot on its own (``where``, sorted); runs with none stay whole."""
    if where.size == 0:
        return starts, ends
    before = np.searchsorted(where, starts)  # index in ``where`` of a run's first own-hot block
    upto = np.searchsorted(where, ends)      # one past its last
    some = upto > before
    starts, ends = starts.copy(), ends.copy()
    starts[some] = where[before[some]]
    ends[some] = where[upto[some] - 1] + 1
    return starts, ends


def _merge(starts: NDArray[np.intp], ends: NDArray[np.intp], apart: NDArray[np.bool_]) -> _Runs:
    """Join consecutive runs; ``apart[i]`` keeps run i and i+1 separate."""
    if starts.size < 2:
        return starts, ends
    cut = np.flatnonzero(apart)
    return np.concatenate((starts[:1], starts[cut + 1])), np.concatenate((ends[cut], ends[-1:]))


def _cap(starts: NDArray[np.intp], ends: NDArray[np.intp], sums: PrefixSums, cap: int) -> _Runs:
    """At most ``cap`` runs: merge across cheap small gaps, then drop the weakest."""
    excess = starts.size - cap
    if excess <= 0:
        return starts, ends
    gaps = starts[1:] - ends[:-1]
    lengths = ends - starts
    cost = gaps / np.minimum(lengths[:-1], lengths[1:])
    order = np.argsort(cost, kind="stable")[:excess]
    order = order[cost[order] <= 1.0]
    apart = np.ones(gaps.size, dtype=bool)
    apart[order] = False
    starts, ends = _merge(starts, ends, apart)
    if starts.size > cap:
        priority = sums.at(ends) - sums.at(starts)
        strongest = np.sort(np.argsort(-priority, kind="stable")[:cap])
        starts, ends = starts[strongest], ends[strongest]
    return starts, ends


def _fill_budget(
    starts: NDArray[np.intp],
    ends: NDArray[np.intp],
    priority: NDArray[np.float64],
    sums: PrefixSums,
    bs: int,
    file_end: int,
    budget: int,
) -> list[Region]:
    """Take regions in the given (priority) order until ``budget`` bytes are used."""
    chosen: list[Region] = []
    left = budget
    for s, e, prio in zip(starts.tolist(), ends.tolist(), priority.tolist()):
        start, end = s * bs, min(e * bs, file_end)
        if end - start > left:
            width = left // bs
            if width == 0:
                continue
            window = sums.at(np.arange(s + width, e + 1)) - sums.at(np.arange(s, e - width + 1))
            best = int(np.argmax(window))
            s, prio = s + best, float(window[best])
            start, end = s * bs, min((s + width) * bs, file_end)
        chosen.append(Region(start, end - start, prio))
        left -= end - start
        if left < PAGE_SIZE:
            break
    chosen.sort(key=lambda r: (-r.priority, r.start))
    return chosen
