"""HeatModel: residency and writes per block -> exponentially decaying heat (pure).

Per cycle, over ``nblocks`` blocks of ``params.block_size`` bytes, with
``v = not ours`` (the blocks whose residency tells something about the guest)::

    S = a_r * gauss(R * v) / gauss(v) + a_w * gauss(W)
    H = d * H + (1 - d) * S                 d  = decay ** (dt / interval)
    H = max(H, dp * H_prev)  where ours     dp = pinned_decay ** (dt / interval)

``gauss`` is the filter of ``scipy.ndimage.gaussian_filter1d`` with
``mode='constant'`` and ``truncate=4`` (same kernel, same result to float32
rounding; the tests check it against scipy), computed as symmetric shifted
adds in float32 (scipy's call costs ~3x more). Its kernel sums to 1, so a
wide, fully resident region gives ``S == a_r`` in its
middle, while an isolated resident block is diluted to
``a_r / (sqrt(2 pi) sigma_r)`` (0.2 a_r at the default sigma of 2): heat
gathers where activity is dense.

Beside ``H`` the model keeps ``own``: the same update of the *unfiltered*
input (``a_r * R * v + a_w * W``, held where ours like ``H``), the heat each
block earned itself. Where the Gaussian spreads one hot block over its
neighbours, ``own`` is high on that block only; the planner cuts runs back
to their blocks hot on their own, so a scattered hot block is pinned without
the cold neighbours it warmed, while a contiguous hot range keeps every
block.

Residency vmcache caused (``ours``: pinned now, or loaded by vmcache and not
yet evicted) is excluded from R, so pinning never feeds back: a pinned
region's residency cannot heat its neighbours, and the pinned set cannot creep
over the disk. Excluded means *unknown*, not *cold*: the read term is a
normalised convolution, the weighted mean of the residency of the nearby
blocks that are not ours (where less than ``_MIN_KNOWN`` of the kernel weight
is known, the term is 0). Treating our blocks as cold instead would make the
guest-read edge blocks of a pinned region look isolated (diluted below the
threshold), and they would never be pinned. The same normalisation treats
the outside of the disk as unknown, so the first and last blocks are not
halved.

Read evidence (``seen``): guest reads of pinned pages are page-cache hits
that mincore cannot see, but they set the pages' referenced bits, which the
engine samples (vmcache.host.pagerefs). A pinned block with such evidence is
no longer "ours" for the step: its residency input is ``min(1, seen_scale *
seen)`` and its heat follows the plain update, so a region the guest keeps
reading stays hot and one it abandoned cools at the normal decay.

Hold and release, where there is no evidence (not root, or a simulation
without it) - what ``pinned_decay`` and the planner's ``keep_factor`` are
for: while a region is pinned, guest *reads* of it leave no trace, so a
read-only pinned region cannot be told from an idle one. With the plain update its heat, which had just crossed the
threshold when it was pinned, would fall back under it within a few cycles
and the region would flap. So blocks in ``ours`` *hold* their heat: it fades
at the slower ``pinned_decay`` (no evidence either way), while fresh evidence
(writes, guest reads next to it) still raises it at the normal rate. Writes
come from the dirty bitmap and are never masked: a region the guest keeps
writing keeps its heat and stays pinned; an idle pinned region fades and is
released after a bounded time. The planner adds hysteresis at the threshold
(``keep_factor``, default 2): a pinned region is kept until its heat falls
below ``threshold / keep_factor``.

With the defaults (a_r=1, decay 0.9 and pinned_decay 0.98 per 10 s,
threshold 0.2, keep_factor 2) a region the guest reads is pinned on the 3rd
cycle (~30 s); once pinned and showing no activity it is released after
``ln(0.1 / h0) / ln(0.98)`` cycles: ~34 (~6 min) for a region pinned as soon
as it crossed the threshold (h0 = 0.2), up to 114 (~19 min) for one that was
hot for long (h0 = 1). A released region stays ``ours`` while resident; once
the kernel evicts it and the guest reads it again, the residency signal
returns and it is pinned again. Without memory pressure it is not evicted,
and pinning it would not have helped anyway.
"""

from __future__ import annotations

import math
from typing import NamedTuple, TypeVar

import numpy as np
from numpy.typing import ArrayLike, NDArray

from .blocks import BlockValues, check_index, dilate, member, positions, union
from .params import ModelParams

__all__ = ["DROP_SHARE", "ActiveHeat", "HeatModel"]

_MIN_KNOWN = 0.1
"""Least share of the read kernel's weight (of what fits on the disk) that
must fall on blocks not ours for the read term of a block to be estimated
(else it is 0)."""

DROP_SHARE = 1e-6
"""A block whose heat and own heat are both at most ``DROP_SHARE * threshold /
keep_factor`` is forgotten: a million times colder than the coldest heat the
planner acts on, hysteresis included. (At 1e-4 the crumbs the dense model
keeps decided a tie between two equally hot windows of a region differently
in tests/unit/test_sparse_model.py; at 1e-6 no plan differed. Decaying from
1 to there takes ~170 cycles at the default decay.)"""

Index = NDArray[np.int64]
_G = TypeVar("_G", bound=np.generic)


class ActiveHeat(NamedTuple):
    """The blocks that have heat: sorted ``blocks``, their ``heat`` and ``own`` heat (read-only)."""

    blocks: Index
    heat: NDArray[np.float32]
    own: NDArray[np.float32]


class HeatModel:
    """Decaying heat of the blocks of one disk that have some; ``step`` once per cycle."""

    def __init__(self, params: ModelParams, nblocks: int, *, drop_share: float = DROP_SHARE) -> None:
        """Start with zero heat over ``nblocks`` blocks; ValueError if negative.

        ``drop_share``: blocks colder than ``drop_share * threshold /
        keep_factor`` are forgotten (0: only those with no heat at all, which
        gives the dense model's numbers to the last bit).
        """
        self._params = params
        self._drop = np.float32(drop_share * params.threshold / params.keep_factor)
        self._read_kernel = _half_kernel(params.read_sigma)
        self._write_kernel = _half_kernel(params.write_sigma)
        self._radius = max(self._read_kernel.size, self._write_kernel.size) - 1
        self._nblocks = 0
        self._blocks: Index = np.zeros(0, np.int64)
        self._heat: NDArray[np.float32] = np.zeros(0, np.float32)
        self._own: NDArray[np.float32] = np.zeros(0, np.float32)
        self._last: float | None = None
        self.resize(nblocks)

    @property
    def params(self) -> ModelParams:
        return self._params

    @property
    def nblocks(self) -> int:
        return self._nblocks

    @property
    def active(self) -> ActiveHeat:
        """The blocks with heat or own heat, and both (sorted, read-only; replaced by each step)."""
        return ActiveHeat(_readonly(self._blocks), _readonly(self._heat), _readonly(self._own))

    @property
    def heat(self) -> NDArray[np.float32]:
        """Heat per block, dense (a new read-only array of ``nblocks``: pictures and tests)."""
        return _readonly(BlockValues(self._blocks, self._heat).to_dense(self._nblocks))

    @property
    def own(self) -> NDArray[np.float32]:
        """Per block, the heat it earned itself: the same update without the filters (dense, read-only).

        Where the Gaussian spreads one hot block over its neighbours, ``own``
        is high only on the block itself; the planner trims runs to the
        blocks that are hot on their own.
        """
        return _readonly(BlockValues(self._blocks, self._own).to_dense(self._nblocks))

    def step(self, residency: ArrayLike, writes: ArrayLike, ours: ArrayLike, now: float,
             seen: ArrayLike | None = None) -> NDArray[np.float32]:
        """Fold one cycle's sample, given as dense per-block arrays, and return the dense heat.

        ``residency``/``writes``: fractions in [0, 1] per block; ``ours``: bool
        per block, residency vmcache caused (excluded from the read signal);
        ``now``: monotonic seconds; ``seen``: read evidence of pinned blocks
        (fraction of sampled pages read since the previous step, NaN where
        there is none). The same as :meth:`step_blocks`, which the engine
        uses. Raises ValueError when an array's shape is not ``(nblocks,)``
        or ``now`` is not finite.
        """
        n = self._nblocks
        res = BlockValues.from_dense(_vector(residency, n, "residency"))
        wr = BlockValues.from_dense(_vector(writes, n, "writes"))
        mine = np.asarray(ours, dtype=bool)
        if mine.shape != (n,):
            raise ValueError(f"ours has shape {mine.shape}, expected ({n},)")
        evidence = None
        if seen is not None:
            values = _vector(seen, n, "seen")
            index = np.flatnonzero(~np.isnan(values)).astype(np.int64)
            evidence = BlockValues(index, values[index].astype(np.float32))
        self.step_blocks(res, wr, np.flatnonzero(mine).astype(np.int64), now, seen=evidence)
        return self.heat

    def step_blocks(self, residency: BlockValues, writes: BlockValues, ours: Index, now: float,
                    seen: BlockValues | None = None) -> ActiveHeat:
        """Fold one cycle's sample into the heat; return :attr:`active`.

        ``residency``/``writes``: fractions in [0, 1] of the blocks listed
        (others 0); ``ours``: sorted blocks whose residency vmcache caused
        (excluded from the read signal); ``now``: monotonic seconds;
        ``seen``: read evidence of pinned blocks (fraction of sampled pages
        read since the previous step; blocks not listed have none): a block
        with evidence is judged by it, not held. The first step counts as
        one full ``interval``; a step at or before the previous ``now``
        changes nothing. Raises ValueError for blocks unsorted, repeated or
        outside the disk, or a ``now`` that is not finite.
        """
        if not math.isfinite(now):
            raise ValueError(f"now must be finite, got {now!r}")
        n = self._nblocks
        res = BlockValues(check_index(residency.index, n, "residency"), np.asarray(residency.value, np.float32))
        wr = BlockValues(check_index(writes.index, n, "writes"), np.asarray(writes.value, np.float32))
        mine = check_index(ours, n, "ours")
        if seen is not None and seen.index.size:
            res, mine = self._with_evidence(res, mine, check_index(seen.index, n, "seen"),
                                            np.asarray(seen.value, np.float32))
        p = self._params
        dt = p.interval if self._last is None else now - self._last
        if dt <= 0:
            return self.active
        self._last = now
        d = np.float32(p.decay ** (dt / p.interval))
        dp = np.float32(p.pinned_decay ** (dt / p.interval))
        guest = ~member(res.index, mine) & (res.value != 0)
        written = bool(p.write_amplitude) and bool(wr.value.any())
        sources = res.index[guest]
        if written:
            sources = union(sources, wr.index[wr.value != 0])
        near, s = self._smoothed(sources, res, wr, mine, written)
        own_in = self._unfiltered(near, res, guest, wr, written)

        blocks = union(self._blocks, near)
        old = positions(blocks, self._blocks)
        at = positions(blocks, near)
        ours_here = member(blocks, mine)
        heat = self._decayed(blocks.size, old, self._heat, at, s, d, dp, ours_here)
        own = self._decayed(blocks.size, old, self._own, at, own_in, d, dp, ours_here)
        keep = (heat > self._drop) | (own > self._drop)
        self._blocks, self._heat, self._own = blocks[keep], heat[keep], own[keep]
        return self.active

    def _smoothed(self, sources: Index, res: BlockValues, wr: BlockValues, mine: Index,
                  written: bool) -> tuple[Index, NDArray[np.float32]]:
        """The blocks within a kernel radius of an input, and ``S`` there (the dense filter's numbers).

        The filters run over the blocks within two radii: every block within
        one radius then has its whole kernel inside that span (or the
        disk's edge, where the dense filter pads with zeros too).
        """
        p, n, reach = self._params, self._nblocks, self._radius
        near = dilate(sources, reach, n)
        if near.size == 0:
            return near, np.zeros(0, np.float32)
        span = dilate(near, reach, n)
        r = np.zeros(span.size, np.float32)
        guest = ~member(res.index, mine) & (res.value != 0)
        r[positions(span, res.index[guest])] = res.value[guest]
        known = np.ones(span.size, np.float32)
        inside = mine[member(mine, span)]
        known[positions(span, inside)] = 0.0
        s = _gauss(r, self._read_kernel)
        s *= self._known_inverse(known)  # normalised: mean residency of the known neighbours
        s *= np.float32(p.read_amplitude)
        if written:
            w = np.zeros(span.size, np.float32)
            w[positions(span, wr.index)] = wr.value
            _gauss(w, self._write_kernel, out=s, scale=p.write_amplitude)
        return near, s[positions(span, near)]

    def _unfiltered(self, near: Index, res: BlockValues, guest: NDArray[np.bool_], wr: BlockValues,
                    written: bool) -> NDArray[np.float32]:
        """The own-heat input over ``near``: ``a_r * R`` where not ours, plus ``a_w * W``."""
        p = self._params
        own = np.zeros(near.size, np.float32)
        own[positions(near, res.index[guest])] = res.value[guest] * np.float32(p.read_amplitude)
        if written:
            hit = wr.value != 0
            own[positions(near, wr.index[hit])] += np.float32(p.write_amplitude) * wr.value[hit]
        return own

    @staticmethod
    def _decayed(size: int, old: NDArray[np.intp], values: NDArray[np.float32], at: NDArray[np.intp],
                 fresh: NDArray[np.float32], d: np.float32, dp: np.float32,
                 ours: NDArray[np.bool_]) -> NDArray[np.float32]:
        """``d * H + (1 - d) * S``, held at ``dp * H`` where ours, over ``size`` blocks."""
        prev = np.zeros(size, np.float32)
        prev[old] = values
        held = prev * dp
        prev *= d
        add = np.zeros(size, np.float32)
        add[at] = fresh
        add *= np.float32(1.0) - d
        prev += add
        np.maximum(prev, held, out=prev, where=ours)
        return prev

    def _with_evidence(self, res: BlockValues, mine: Index, index: Index,
                       seen: NDArray[np.float32]) -> tuple[BlockValues, Index]:
        """Blocks with read evidence count as known, with residency ``min(1, seen_scale * seen)``."""
        keep = ~np.isnan(seen)
        index, seen = index[keep], seen[keep]
        if index.size == 0:
            return res, mine
        blocks = union(res.index, index)
        values = np.zeros(blocks.size, np.float32)
        values[positions(blocks, res.index)] = res.value
        values[positions(blocks, index)] = np.minimum(np.float32(1.0), seen * np.float32(self._params.seen_scale))
        return BlockValues(blocks, values), mine[~member(mine, index)]

    def _known_inverse(self, known: NDArray[np.float32]) -> NDArray[np.float32]:
        """``1 / gauss(not ours)``, 0 where too little is known (``known`` is overwritten)."""
        weight = _gauss(known, self._read_kernel)
        enough = weight >= self._min_known
        np.divide(np.float32(1.0), weight, out=weight, where=enough)
        weight[~enough] = 0.0
        return weight

    def seed(self, first: int, end: int, heat: float) -> None:
        """Raise the heat (and own heat) of blocks ``[first, end)`` to at least ``heat``.

        How a saved hot set warms a new model: the seeded blocks then follow
        the normal update, so blocks the guest no longer uses decay and are
        released as usual. Blocks past ``nblocks`` are ignored; raises
        ValueError for a negative or non-finite ``heat``.
        """
        if not math.isfinite(heat) or heat < 0:
            raise ValueError(f"seed heat must be finite and not negative, got {heat!r}")
        first, end = max(0, first), min(end, self.nblocks)
        if first < end and heat > 0:
            value = np.float32(heat)
            blocks = union(self._blocks, np.arange(first, end, dtype=np.int64))
            old = positions(blocks, self._blocks)
            seeded = positions(blocks, np.arange(first, end, dtype=np.int64))
            for name in ("_heat", "_own"):
                values = np.zeros(blocks.size, np.float32)
                values[old] = getattr(self, name)
                values[seeded] = np.maximum(values[seeded], value)
                setattr(self, name, values)
            self._blocks = blocks

    def resize(self, nblocks: int) -> None:
        """The disk grew or shrank: keep the heat of surviving blocks, new ones start cold."""
        if nblocks < 0:
            raise ValueError(f"nblocks must not be negative, got {nblocks}")
        keep = self._blocks < nblocks
        self._blocks, self._heat, self._own = self._blocks[keep], self._heat[keep], self._own[keep]
        self._nblocks = nblocks
        # a disk shorter than the kernel never sees the whole kernel weight
        half, mid = self._read_kernel, (nblocks - 1) // 2
        mass = float(half[0] + half[1 : min(mid, half.size - 1) + 1].sum()
                     + half[1 : min(nblocks - 1 - mid, half.size - 1) + 1].sum())
        self._min_known = np.float32(_MIN_KNOWN * mass)

    def reset(self) -> None:
        """Forget all heat and the time of the last step."""
        self._blocks = np.zeros(0, np.int64)
        self._heat = np.zeros(0, np.float32)
        self._own = np.zeros(0, np.float32)
        self._last = None


def _readonly(array: NDArray[_G]) -> NDArray[_G]:
    view = array.view()
    view.flags.writeable = False
    return view


def _gauss(values: NDArray[np.float32], half: NDArray[np.float32], *, out: NDArray[np.float32] | None = None,
           scale: float = 1.0) -> NDArray[np.float32]:
    """``scale * gauss(values)`` (zeros outside), added to ``out`` when given, else a new array."""
    n, r = values.shape[0], half.size - 1
    pad = np.zeros(n + 2 * r, dtype=np.float32)
    pad[r : r + n] = values
    centre = pad[r : r + n]
    if out is None:
        out = np.multiply(centre, np.float32(half[0] * scale))
    else:
        out += np.multiply(centre, np.float32(half[0] * scale))
    tmp = np.empty(n, dtype=np.float32)
    for k in range(1, r + 1):  # one pass per kernel tap pair, not per block
        np.add(pad[r - k : r - k + n], pad[r + k : r + k + n], out=tmp)
        tmp *= np.float32(half[k] * scale)
        out += tmp
    return out


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
