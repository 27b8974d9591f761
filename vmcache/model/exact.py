"""The cycle's exact path: what the guest's reads counted exactly make of the model's inputs (pure).

With the guest's reads counted (:class:`~vmcache.model.reads.GuestReads`)
:func:`read_input` gives each block what it was read, and the cycle can
measure what the inferred path had to assume: :class:`ReadBack`, the share
of the blocks the guest writes that it reads back soon after, and
:class:`PinShare`, how much of its budget pins are worth against the
kernel's own cache.

On writes: :class:`ReadBack`. Under ``cache='writethrough'`` a write goes to the device
whatever is cached; keeping written data pays only when it is read again.
A database log or a web server's access logs are written and never read; a
guest whose own page cache evicts and re-reads files reads back what it
wrote. The cycle weighs the write input by this share.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from collections.abc import Sequence

from .blocks import BlockValues, blocks_of, member, positions, union
from .params import PAGE_SIZE, ModelParams
from .region import Region

__all__ = ["PinShare", "ReadBack", "READ_BACK_HORIZON", "read_input"]

READ_BACK_HORIZON = 6
"""Cycles after a write in which a read of the block counts as reading it back (one minute at 10 s)."""


def read_input(pages: BlockValues, params: ModelParams, nblocks: int) -> BlockValues:
    """Each block's read input for one cycle, from the pages the guest read in it (hits and misses).

    How much of the block was read (``seen_scale`` x pages read / pages in
    the block) or, where more, its share of the cycle's reads against its
    fair share (``miss_contrast`` times the cycle's pages spread evenly
    over the disk: a slow guest's hot blocks show at once), at most 1
    either way: a block read in one cycle only - a one-pass read, a
    backup's stream - heats to ``1 - decay``, under the threshold, and only
    reads over several cycles pin it. Pinned or not, a block is as hot as
    it is read: nothing is masked, inferred from residency or held.
    """
    p = params
    value = pages.value * np.float32(p.seen_scale * PAGE_SIZE / p.block_size)
    total = float(pages.value.sum(dtype=np.float64))
    if total > 0 and p.miss_contrast > 0:
        np.maximum(value, pages.value * np.float32(nblocks / (p.miss_contrast * total)), out=value)
    return BlockValues(pages.index, np.minimum(np.float32(1.0), value))


class ReadBack:
    """The share of written blocks read back within ``horizon`` cycles, a running mean over ``memory`` outcomes.

    Starts at ``prior`` (1.0: writes count in full until the guest shows it
    does not read them back, as the inferred path assumes).
    """

    def __init__(self, *, horizon: int = READ_BACK_HORIZON, memory: float = 200.0, prior: float = 1.0) -> None:
        self.horizon = horizon
        self._memory = memory
        self.share = prior
        self._written: dict[int, int] = {}  # block -> cycles since its last write, not read since

    def update(self, written: NDArray[np.int64], read: NDArray[np.int64]) -> float:
        """One cycle: the blocks written, the blocks read (both sorted); the share after it.

        A pending write's outcome is "read back" when its block is read
        within ``horizon`` cycles, "not read back" when the horizon passes
        or the block is written again first (the data it kept was never
        read).
        """
        pending = self._written
        hits = 0
        if pending and read.size:
            known = np.fromiter(pending, np.int64, len(pending))
            known.sort()
            for block in read[member(read, known)].tolist():
                del pending[block]
                hits += 1
        misses = 0
        for block in [b for b, age in pending.items() if age >= self.horizon]:
            del pending[block]
            misses += 1
        for block in pending:
            pending[block] += 1
        for block in written.tolist():
            misses += block in pending
            pending[block] = 0
        outcomes = hits + misses
        if outcomes:
            weight = min(1.0, outcomes / self._memory)
            self.share += weight * (hits / outcomes - self.share)
        return self.share


class PinShare:
    """The share of its pin budget the cycle uses, balanced by misses as ARC balances its two lists.

    A pin takes memory from the kernel's own cache. Which of the two would
    have saved this cycle's read misses shows where the next byte is worth
    more: misses on blocks the plan wanted but the share left out (the
    pins' ghosts) say pin more; misses on other blocks the kernel's cache
    held a few cycles ago and evicted since (its ghosts) say leave it more. The
    share moves by ``step`` towards the side with more ghost misses, in
    proportion to the difference, between 0 and 1. Each ghost list
    remembers ``memory`` cycles.

    A block the kernel held counts by the fraction of it that was cached:
    a missed page of a block it held a page of was most likely never
    cached at all (a 4 KiB read into a cold 1 MiB block makes the block
    "resident"), and counted in full such misses - the scattered reads
    beside any hot set - would take the pins away from a hot set the
    kernel could not have kept better. A pin holds its whole block, so
    the pins' ghosts count in full.
    """

    def __init__(self, *, step: float = 0.05, memory: int = 6, start: float = 1.0) -> None:
        self.value = start
        self._step = step
        self._memory = memory
        self._pin_ghosts: list[NDArray[np.int64]] = []
        self._rest_ghosts: list[BlockValues] = []   # blocks the kernel held, and the fraction of each

    def update(self, missed_index: NDArray[np.int64], missed_pages: NDArray[np.float32]) -> float:
        """Weigh this cycle's misses (blocks, pages) against both ghost lists; the share after it."""
        wanted = member(missed_index, _union(self._pin_ghosts))  # the plan wanted it: the pins' miss
        pin = float(missed_pages[wanted].sum(dtype=np.float64))
        cached = _most(self._rest_ghosts).at(missed_index)
        cached[wanted] = 0.0
        rest = float((missed_pages * cached).sum(dtype=np.float64))
        if pin + rest > 0:
            self.value = min(1.0, max(0.0, self.value + self._step * (pin - rest) / (pin + rest)))
        return self.value

    def remember_plans(self, wanted: Sequence[Region], taken: Sequence[Region], resident: BlockValues,
                       block_size: int, nblocks: int) -> None:
        """After the plan: the blocks the plan at the whole budget ``wanted`` and the share left out of what
        was ``taken``, and the ``resident`` blocks the kernel's cache holds, with the fraction of each."""
        want, took = blocks_of(wanted, block_size, nblocks), blocks_of(taken, block_size, nblocks)
        rest = ~member(resident.index, took)
        self.remember(want[~member(want, took)], BlockValues(resident.index[rest], resident.value[rest]))

    def remember(self, left_out: NDArray[np.int64], kernel_held: BlockValues) -> None:
        """After the plan: the blocks it wanted but left out, and the blocks the kernel's cache holds (sorted)
        with the fraction of each."""
        self._pin_ghosts.append(left_out)
        self._rest_ghosts.append(kernel_held)
        del self._pin_ghosts[:-self._memory]
        del self._rest_ghosts[:-self._memory]


def _most(lists: list[BlockValues]) -> BlockValues:
    """Each block listed in any of ``lists`` with the largest value it had in them."""
    if not lists:
        return BlockValues.empty()
    index = union(*(b.index for b in lists))
    value = np.zeros(index.size, np.float32)
    for held in lists:   # one per remembered cycle, a few
        at = positions(index, held.index)
        value[at] = np.maximum(value[at], held.value)
    return BlockValues(index, value)


def _union(arrays: list[NDArray[np.int64]]) -> NDArray[np.int64]:
    return union(*arrays) if arrays else np.zeros(0, dtype=np.int64)
