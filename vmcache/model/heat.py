"""HeatModel: residency and writes per block -> exponentially decaying heat (pure).

Per cycle, over ``nblocks`` blocks of ``params.block_size`` bytes, with
``v = not ours`` (the blocks whose residency tells something about the guest)::

    S = a_r * gauss(R * v) / gauss(v) + a_w * gauss(W)
    H = d * H + (1 - d) * S                 d  = decay ** (dt / interval)
    H = max(H, dp * H_prev)  where ours     dp = pinned_decay ** (dt / interval)

``gauss`` is the filter of ``scipy.ndimage.gaussian_filter1d`` with
``mode='constant'`` and ``truncate=4`` (same kernel, same result to float32
rounding; the tests check it against scipy), computed as symmetric shifted
adds in float32: ~4-5.5 ms instead of scipy's ~17 ms for 1M blocks at sigma 2,
which matters when one agent runs a model per disk. Its kernel sums to 1, so a wide, fully resident region gives ``S == a_r`` in its
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
halved. ``gauss(v)`` changes only when ``ours`` does and is cached.

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

import numpy as np
from numpy.typing import ArrayLike, NDArray
from .params import ModelParams

__all__ = ["HeatModel"]

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
        if first < end:
            value = np.float32(heat)
            np.maximum(self._heat[first:end], value, out=self._heat[first:end])
            np.maximum(self._own[first:end], value, out=self._own[first:end])

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
        self._ours: NDArray[np.bool_] | None = None
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
