"""Sparse per-block values: sorted block indices and one value each (pure numpy).

A disk of 64 TiB has 64M blocks of 1 MiB, of which a guest touches a few
thousand; the model and the planner keep and take only the blocks with
something to say. :class:`BlockValues` is that form for an input
(residency, writes, read evidence); the helpers below are the few set
operations the model needs on sorted index arrays.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

from .region import Region

__all__ = ["BlockValues", "PrefixSums", "binned", "blocks_mask", "blocks_of", "check_index", "dilate", "listed",
           "member", "positions", "runs", "union", "window_mean"]

Index = NDArray[np.int64]


@dataclass(frozen=True)
class BlockValues:
    """``value[i]`` belongs to block ``index[i]``; ``index`` sorted, unique; blocks not listed are 0."""

    index: Index
    value: NDArray[np.float32]

    @classmethod
    def empty(cls) -> BlockValues:
        return cls(np.zeros(0, np.int64), np.zeros(0, np.float32))

    @classmethod
    def from_dense(cls, values: ArrayLike) -> BlockValues:
        """The non-zero entries of a dense per-block array (NaN counts as a value)."""
        array = np.asarray(values)
        index = np.flatnonzero(array != 0).astype(np.int64)
        return cls(index, array[index].astype(np.float32))

    def at(self, blocks: Index) -> NDArray[np.float32]:
        """The values of sorted ``blocks`` (0 for blocks not listed)."""
        out = np.zeros(blocks.size, dtype=np.float32)
        if self.index.size and blocks.size:
            where = np.minimum(np.searchsorted(self.index, blocks), self.index.size - 1)
            found = self.index[where] == blocks
            out[found] = self.value[where[found]]
        return out

    def to_dense(self, nblocks: int, fill: float = 0.0) -> NDArray[np.float32]:
        """The dense per-block array (O(nblocks): for pictures and tests, not for the cycle)."""
        out = np.full(nblocks, fill, dtype=np.float32)
        keep = self.index < nblocks
        out[self.index[keep]] = self.value[keep]
        return out


def check_index(index: Index, nblocks: int, name: str) -> Index:
    """``index`` as int64 if sorted, unique and inside ``[0, nblocks)``; ValueError otherwise."""
    index = np.asarray(index, dtype=np.int64)
    if index.ndim != 1:
        raise ValueError(f"{name} blocks must be one-dimensional, got shape {index.shape}")
    if index.size and (index[0] < 0 or index[-1] >= nblocks or np.any(index[1:] <= index[:-1])):
        raise ValueError(f"{name} blocks must be sorted, unique and in [0, {nblocks})")
    return index


def listed(values: BlockValues | ArrayLike, nblocks: int, name: str, *, nan_is_none: bool = False) -> BlockValues:
    """``values`` as listed blocks: as given, or the non-zero (not NaN) entries of a dense array.

    Raises ValueError for a dense array that is not ``(nblocks,)`` (``name`` says which).
    """
    if isinstance(values, BlockValues):
        return values
    array = np.asarray(values)
    if array.shape != (nblocks,):
        raise ValueError(f"{name} has shape {array.shape}, expected ({nblocks},)")
    index = np.flatnonzero(~np.isnan(array) if nan_is_none else array != 0).astype(np.int64)
    return BlockValues(index, array[index].astype(np.float32))


def runs(index: Index) -> tuple[Index, Index]:
    """Maximal runs of consecutive blocks in sorted unique ``index``, as half-open [start, end)."""
    if index.size == 0:
        return index[:0], index[:0]
    cut = np.flatnonzero(np.diff(index) != 1)
    starts = np.concatenate((index[:1], index[cut + 1]))
    ends = np.concatenate((index[cut] + 1, index[-1:] + 1))
    return starts, ends


def dilate(index: Index, radius: int, nblocks: int) -> Index:
    """Every block within ``radius`` of a block of ``index``, inside ``[0, nblocks)`` (sorted)."""
    if index.size == 0 or radius == 0:
        return index.copy()
    starts, ends = runs(index)
    starts = np.maximum(starts - radius, 0)
    ends = np.minimum(ends + radius, nblocks)
    apart = np.flatnonzero(starts[1:] > ends[:-1])  # runs grown into each other are joined
    starts = np.concatenate((starts[:1], starts[apart + 1]))
    ends = np.concatenate((ends[apart], ends[-1:]))
    lengths = ends - starts
    offsets = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    blocks: Index = np.repeat(starts, lengths) + offsets
    return blocks


def positions(within: Index, blocks: Index) -> NDArray[np.intp]:
    """Where each of ``blocks`` (all present in sorted ``within``) sits in ``within``."""
    return np.searchsorted(within, blocks)


def member(blocks: Index, of: Index) -> NDArray[np.bool_]:
    """Per block of ``blocks``: is it in sorted ``of``."""
    if of.size == 0 or blocks.size == 0:
        return np.zeros(blocks.size, dtype=bool)
    at = np.minimum(np.searchsorted(of, blocks), of.size - 1)
    found: NDArray[np.bool_] = of[at] == blocks
    return found


def union(*indices: Index) -> Index:
    """The sorted union of sorted unique block indices (np.union1d without its hashing)."""
    joined = np.concatenate(indices).astype(np.int64, copy=False)
    joined.sort(kind="stable")  # runs of sorted input: a merge, not a full sort
    if joined.size < 2:
        return joined
    return joined[np.concatenate(([True], joined[1:] != joined[:-1]))]


class PrefixSums:
    """Sum of the values of all blocks before a block (float64), from the blocks that have one.

    The same numbers as ``cumsum`` over the dense array: blocks not listed
    add exactly nothing.
    """

    def __init__(self, blocks: Index, values: NDArray[np.floating]) -> None:
        self._blocks = blocks
        self._sums = np.zeros(blocks.size + 1, dtype=np.float64)
        np.cumsum(values, dtype=np.float64, out=self._sums[1:])

    def at(self, block: ArrayLike) -> NDArray[np.float64]:
        """The sums before each of ``block``."""
        return self._sums[np.searchsorted(self._blocks, block)]


def blocks_mask(regions: Iterable[Region], block_size: int, nblocks: int) -> NDArray[np.bool_]:
    """Bool per block: True where any byte of the block lies in one of ``regions``."""
    mask = np.zeros(nblocks, dtype=bool)
    for region in regions:  # one slice per region, not per block
        if region.length > 0:
            mask[max(region.start // block_size, 0) : -(-region.end // block_size)] = True
    return mask


def blocks_of(regions: Iterable[Region], block_size: int, nblocks: int) -> Index:
    """The blocks below ``nblocks`` with any byte in one of ``regions`` (sorted, unique)."""
    spans = np.array([(r.start // block_size, -(-r.end // block_size)) for r in regions if r.length > 0],
                     dtype=np.int64).reshape(-1, 2)
    starts = np.maximum(spans[:, 0], 0)
    lengths = np.maximum(np.minimum(spans[:, 1], nblocks) - starts, 0)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    blocks: Index = np.repeat(starts, lengths) + offsets
    if spans.shape[0] > 1:
        blocks.sort()
        blocks = blocks[np.concatenate(([True], blocks[1:] != blocks[:-1]))]
    return blocks


def binned(values: BlockValues, factor: int, nblocks: int, *, hottest: bool = False) -> NDArray[np.float32]:
    """Per bin of ``factor`` consecutive blocks (of ``nblocks``): the mean of ``values`` or the largest.

    Blocks not listed count as 0 in the mean; the last bin, shorter when
    ``factor`` does not divide ``nblocks``, is the mean of its own blocks.
    ``factor`` 1 gives the dense array. Raises ValueError for a factor under 1.
    """
    if factor < 1:
        raise ValueError(f"factor must be at least 1, got {factor}")
    nbins = -(-nblocks // factor)
    keep = values.index < nblocks
    bins, vals = values.index[keep] // factor, values.value[keep]
    if hottest:
        out = np.zeros(nbins, dtype=np.float32)
        np.maximum.at(out, bins, vals)
        return out
    sizes = np.full(nbins, float(factor))
    if nbins:
        sizes[-1] = nblocks - (nbins - 1) * factor
    means: NDArray[np.float32] = (np.bincount(bins, weights=vals, minlength=nbins) / sizes).astype(np.float32)
    return means


def window_mean(index: NDArray[np.int64], value: NDArray[np.float32], reach: int) -> NDArray[np.float32]:
    """Per listed block, the mean ``value`` of the listed blocks within ``reach`` blocks of it (``index`` sorted)."""
    if reach <= 0 or index.size == 0:
        return value
    sums: NDArray[np.float64] = np.concatenate(([0.0], np.cumsum(value, dtype=np.float64)))
    lo = np.searchsorted(index, index - reach, side="left")
    hi = np.searchsorted(index, index + reach, side="right")
    mean: NDArray[np.float64] = (sums[hi] - sums[lo]) / (hi - lo)
    return mean.astype(np.float32)
