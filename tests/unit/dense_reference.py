"""The dense heat model and planner as they were before the sparse form (commit 213fa0c): the reference.

vmcache.model keeps heat only for the blocks that have some and filters
only near its inputs; tests/unit/test_sparse_model.py checks that it gives
the same heat (to the last bit, but for the blocks it forgot far below the
threshold) and the same plans as this code, which allocates every array
over the whole disk. Kept as it was; not used by the product.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
from numpy.typing import ArrayLike, NDArray

from vmcache.model.params import PAGE_SIZE, ModelParams
from vmcache.model.region import Region


_MIN_KNOWN = 0.1
"""Least share of the read kernel's weight (of what fits on the disk) that
must fall on blocks not ours for the read term of a block to be estimated
(else it is 0)."""


class HeatModel:
    """Decaying heat per block of one disk; ``step`` once per cycle.

    Arrays are float32 and reused between steps (a 1 TiB image at 1 MiB
    blocks is 1M blocks, ~4 MiB per array, six arrays).
    """

    def __init__(self, params: ModelParams, nblocks: int) -> None:
        """Start with zero heat over ``nblocks`` blocks; ValueError if negative."""
        self._params = params
        self._heat = np.zeros(0, dtype=np.float32)
        self._own = np.zeros(0, dtype=np.float32)
        self._last: float | None = None
        self._ours: NDArray[np.bool_] | None = None
        self._read_kernel: NDArray[np.float32] = _half_kernel(params.read_sigma)
        self._min_known = np.float32(0.0)
        self._alloc(nblocks)

    @property
    def params(self) -> ModelParams:
        return self._params

    @property
    def nblocks(self) -> int:
        return int(self._heat.shape[0])

    @property
    def heat(self) -> NDArray[np.float32]:
        """Current heat per block (read-only view, updated in place by ``step``)."""
        view = self._heat.view()
        view.flags.writeable = False
        return view

    @property
    def own(self) -> NDArray[np.float32]:
        """Per block, the heat it earned itself: the same update without the filters.

        Where the Gaussian spreads one hot block over its neighbours, ``own``
        is high only on the block itself; the planner trims runs to the
        blocks that are hot on their own (read-only view).
        """
        view = self._own.view()
        view.flags.writeable = False
        return view

    def step(self, residency: ArrayLike, writes: ArrayLike, ours: ArrayLike, now: float,
             seen: ArrayLike | None = None) -> NDArray[np.float32]:
        """Fold one cycle's sample into the heat and return it (read-only view).

        ``residency``/``writes``: fractions in [0, 1] per block; ``ours``: bool
        per block, residency vmcache caused (excluded from the read signal);
        ``now``: monotonic seconds; ``seen``: read evidence of pinned blocks
        (fraction of sampled pages read since the previous step, NaN where
        there is none): a block with evidence is judged by it, not held.
        The first step counts as one full ``interval``; a step at or before
        the previous ``now`` changes nothing. Raises ValueError when an
        array's shape is not ``(nblocks,)`` or ``now`` is not finite.
        """
        if not math.isfinite(now):
            raise ValueError(f"now must be finite, got {now!r}")
        n = self.nblocks
        res = _vector(residency, n, "residency")
        wr = _vector(writes, n, "writes")
        mine = np.asarray(ours, dtype=bool)
        if mine.shape != (n,):
            raise ValueError(f"ours has shape {mine.shape}, expected ({n},)")
        if seen is not None:
            res, mine = self._with_evidence(res, mine, _vector(seen, n, "seen"))

        p = self._params
        dt = p.interval if self._last is None else now - self._last
        if dt <= 0:
            return self.heat
        self._last = now
        d = np.float32(p.decay ** (dt / p.interval))
        dp = np.float32(p.pinned_decay ** (dt / p.interval))

        r, s = self._r, self._s
        inverse = self._known_inverse(mine)
        np.copyto(r, res, casting="unsafe")
        np.copyto(r, 0.0, where=mine)
        self._gauss(r, self._read_kernel, s, tmp=r)
        s *= inverse  # normalised: mean residency of the known neighbours
        s *= np.float32(p.read_amplitude)
        written = bool(p.write_amplitude) and bool(wr.any())
        if written:
            self._gauss(wr, self._write_kernel, s, tmp=r, scale=p.write_amplitude, add=True)
        held = r  # free again
        np.multiply(self._heat, dp, out=held)
        self._heat *= d
        s *= np.float32(1.0) - d
        self._heat += s
        np.maximum(self._heat, held, out=self._heat, where=mine)

        # the same update without the filters: what each block showed itself
        own = s
        np.multiply(res, np.float32(p.read_amplitude), out=own, casting="unsafe")
        own[mine] = 0.0
        if written:
            own += np.float32(p.write_amplitude) * wr.astype(np.float32, copy=False)
        np.multiply(self._own, dp, out=held)
        self._own *= d
        own *= np.float32(1.0) - d
        self._own += own
        np.maximum(self._own, held, out=self._own, where=mine)
        return self.heat

    def _with_evidence(self, res: NDArray[np.floating], mine: NDArray[np.bool_],
                       seen: NDArray[np.floating]) -> tuple[NDArray[np.floating], NDArray[np.bool_]]:
        """Blocks with read evidence count as known, with residency ``min(1, seen_scale * seen)``."""
        evident = ~np.isnan(seen)
        if not evident.any():
            return res, mine
        res = np.array(res, dtype=np.float32, copy=True)
        res[evident] = np.minimum(np.float32(1.0), seen[evident] * np.float32(self._params.seen_scale))
        return res, mine & ~evident

    def resize(self, nblocks: int) -> None:
        """The disk grew or shrank: keep the heat of surviving blocks, new ones start cold."""
        self._alloc(nblocks)

    def reset(self) -> None:
        """Forget all heat and the time of the last step."""
        self._heat.fill(0.0)
        self._own.fill(0.0)
        self._last = None

    def _known_inverse(self, mine: NDArray[np.bool_]) -> NDArray[np.float32]:
        """``1 / gauss(not ours)`` (0 where too little is known), cached per ``ours``."""
        if self._ours is not None and np.array_equal(self._ours, mine):
            return self._inverse
        known = self._inverse
        np.logical_not(mine, out=self._r, casting="unsafe")
        self._gauss(self._r, self._read_kernel, known, tmp=self._r)
        enough = known >= self._min_known
        np.divide(np.float32(1.0), known, out=known, where=enough)
        known[~enough] = 0.0
        self._ours = mine.copy()
        return known

    def _alloc(self, nblocks: int) -> None:
        if nblocks < 0:
            raise ValueError(f"nblocks must not be negative, got {nblocks}")
        heat = np.zeros(nblocks, dtype=np.float32)
        keep = min(nblocks, self._heat.shape[0])
        heat[:keep] = self._heat[:keep]
        self._heat = heat
        own = np.zeros(nblocks, dtype=np.float32)
        own[:keep] = self._own[:keep]
        self._own = own
        self._r = np.empty(nblocks, dtype=np.float32)
        self._s = np.empty(nblocks, dtype=np.float32)
        self._inverse = np.empty(nblocks, dtype=np.float32)
        self._ours = None
        self._read_kernel = _half_kernel(self._params.read_sigma)
        self._write_kernel = _half_kernel(self._params.write_sigma)
        # a disk shorter than the kernel never sees the whole kernel weight
        half, mid = self._read_kernel, (nblocks - 1) // 2
        mass = float(half[0] + half[1 : min(mid, half.size - 1) + 1].sum()
                     + half[1 : min(nblocks - 1 - mid, half.size - 1) + 1].sum())
        self._min_known = np.float32(_MIN_KNOWN * mass)
        margin = max(self._read_kernel.size, self._write_kernel.size) - 1
        self._pad = np.zeros(nblocks + 2 * margin, dtype=np.float32)

    def _gauss(
        self,
        values: NDArray[np.generic],
        half: NDArray[np.float32],
        out: NDArray[np.float32],
        *,
        tmp: NDArray[np.float32],
        scale: float = 1.0,
        add: bool = False,
    ) -> None:
        """``out (+)= scale * gauss(values)`` (zeros outside); ``tmp`` may be ``values``."""
        n, r = values.shape[0], half.size - 1
        pad = self._pad
        pad[:r] = 0.0
        np.copyto(pad[r : r + n], values, casting="unsafe")
        pad[r + n : 2 * r + n] = 0.0
        centre = pad[r : r + n]
        if add:
            np.multiply(centre, np.float32(half[0] * scale), out=tmp)
            out += tmp
        else:
            np.multiply(centre, np.float32(half[0] * scale), out=out)
        for k in range(1, r + 1):  # one pass per kernel tap pair, not per block
            np.add(pad[r - k : r - k + n], pad[r + k : r + k + n], out=tmp)
            tmp *= np.float32(half[k] * scale)
            out += tmp


def _vector(values: ArrayLike, n: int, name: str) -> NDArray[np.floating]:
    array = np.asarray(values)
    if array.shape != (n,):
        raise ValueError(f"{name} has shape {array.shape}, expected ({n},)")
    return array


def _half_kernel(sigma: float) -> NDArray[np.float32]:
    """Weights at distance 0..radius of scipy's Gaussian kernel (truncate=4, sum 1)."""
    if sigma <= 0:
        return np.ones(1, dtype=np.float32)
    radius = int(4.0 * sigma + 0.5)
    x = np.arange(-radius, radius + 1, dtype=np.float64)
    weights = np.exp(-0.5 / (sigma * sigma) * x * x)
    weights /= weights.sum()
    return weights[radius:].astype(np.float32)


# ---- planner



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
    """Choose the regions to pin for one disk (see the module docstring).

    ``heat``: heat per block (``HeatModel.heat``); ``size_bytes``: size of the
    image file; ``budget``: bytes that may be pinned for it; ``current``: the
    regions pinned now (hysteresis); ``own``: ``HeatModel.own``, to trim runs
    to the blocks hot on their own (step 2). Raises ValueError for a heat
    array that is not one-dimensional or a negative size or budget.
    """
    values = np.asarray(heat)
    if values.ndim != 1:
        raise ValueError(f"heat must be one-dimensional, got shape {values.shape}")
    if size_bytes < 0 or budget < 0:
        raise ValueError(f"size_bytes and budget must not be negative, got {size_bytes}, {budget}")
    bs = params.block_size
    budget = budget - budget % PAGE_SIZE
    file_end = -(-size_bytes // PAGE_SIZE) * PAGE_SIZE
    nblocks = min(values.shape[0], -(-size_bytes // bs))
    if budget == 0 or nblocks == 0:
        return []
    inside = _inside(current, nblocks, params)
    eff = _effective_heat(values[:nblocks], inside, params)

    starts, ends = _hot_runs(eff > params.threshold)
    if own is not None:
        own_eff = _effective_heat(np.asarray(own)[:nblocks], inside, params)
        starts, ends = _trim_to_own(starts, ends, own_eff > params.threshold)
    starts, ends = _merge(starts, ends, (starts[1:] - ends[:-1]) > params.merge_gap)
    long_enough = (ends - starts) >= params.min_region
    starts, ends = starts[long_enough], ends[long_enough]
    if starts.size == 0:
        return []

    sums = np.zeros(nblocks + 1, dtype=np.float64)
    np.cumsum(eff, dtype=np.float64, out=sums[1:])
    starts, ends = _cap(starts, ends, sums, params.max_regions)
    priority = sums[ends] - sums[starts]
    order = np.lexsort((starts, -priority))
    return _fill_budget(starts[order], ends[order], priority[order], sums, bs, file_end, budget)


def _inside(current: Iterable[Region], nblocks: int, params: ModelParams) -> NDArray[np.bool_] | None:
    """Blocks of the current regions (None when there is no hysteresis to apply)."""
    if params.keep_factor == 1.0:
        return None
    bs = params.block_size
    inside = np.zeros(nblocks, dtype=bool)
    for region in current:  # one slice per pinned region, not per block
        if region.length > 0:
            inside[max(region.start // bs, 0) : -(-region.end // bs)] = True
    return inside


def _effective_heat(heat: NDArray[np.generic], inside: NDArray[np.bool_] | None,
                    params: ModelParams) -> NDArray[np.float32]:
    """Heat as float32, times ``keep_factor`` on the blocks ``inside`` the current regions."""
    eff = heat.astype(np.float32, copy=True)
    if inside is not None:
        np.multiply(eff, np.float32(params.keep_factor), out=eff, where=inside)
    return eff


def _hot_runs(hot: NDArray[np.bool_]) -> _Runs:
    """Maximal runs of True as half-open block ranges [start, end)."""
    edges = np.flatnonzero(np.diff(hot.view(np.int8), prepend=np.int8(0), append=np.int8(0)))
    return edges[0::2], edges[1::2]


def _trim_to_own(starts: NDArray[np.intp], ends: NDArray[np.intp], hot_itself: NDArray[np.bool_]) -> _Runs:
    """Cut each run back to its first and last block hot on its own; runs with none stay whole."""
    where = np.flatnonzero(hot_itself)
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


def _cap(starts: NDArray[np.intp], ends: NDArray[np.intp], sums: NDArray[np.float64], cap: int) -> _Runs:
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
        priority = sums[ends] - sums[starts]
        strongest = np.sort(np.argsort(-priority, kind="stable")[:cap])
        starts, ends = starts[strongest], ends[strongest]
    return starts, ends


def _fill_budget(
    starts: NDArray[np.intp],
    ends: NDArray[np.intp],
    priority: NDArray[np.float64],
    sums: NDArray[np.float64],
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
            window = sums[s + width : e + 1] - sums[s : e - width + 1]
            best = int(np.argmax(window))
            s, prio = s + best, float(window[best])
            start, end = s * bs, min((s + width) * bs, file_end)
        chosen.append(Region(start, end - start, prio))
        left -= end - start
        if left < PAGE_SIZE:
            break
    chosen.sort(key=lambda r: (-r.priority, r.start))
    return chosen
