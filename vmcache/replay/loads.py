"""Whether what vmcache's pins loaded was read: the use of its loads (pure).

A new pin of a block that is not all cached reads the rest from the device
(the agent's ``prefetch_rate`` bounds how fast). That is worth its device
reads only where the guest then reads what was loaded: a zone the guest
reads all over, filled ahead of its misses, pays; the cold pages beside a
few hot ones in a block do not. :class:`Loads` records each cycle's loaded
units and counts those the guest read within ``horizon`` seconds of trace
time after the load (:data:`HORIZON`: two minutes, a dozen 10 s cycles).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from .accesses import BlockTrace

__all__ = ["HORIZON", "WASTE_HORIZON", "Loads", "read_within"]

HORIZON = 120.0
"""Seconds of trace time after a load in which a guest read of the unit counts as its use."""
WASTE_HORIZON = 300.0
"""Seconds after a load the guest must read the unit in for the load not to count as waste
(``loaded_unread_bytes``: a warm start's bet is on the first minutes)."""


def read_within(bt: BlockTrace, times: NDArray[np.float64], units: NDArray[np.int64],
                horizon: float = HORIZON) -> NDArray[np.bool_]:
    """Per load (unit ``units[i]`` loaded at trace time ``times[i]``): does a guest read of it follow in ``horizon``?

    A read at the load's own time counts as following it: the cycle that
    loads ends at that time and the read is the next cycle's. A load the
    next load of the same unit comes before any read of it was not used
    (the unit was let go and loaded again).
    Raises ValueError when the arrays differ in length.
    """
    if times.shape != units.shape:
        raise ValueError(f"{times.size} load times for {units.size} units")
    reads = ~bt.write
    n = units.size
    unit = np.concatenate((units, bt.block[reads]))
    time = np.concatenate((times, bt.time[reads]))
    is_read = np.arange(unit.size) >= n
    order = np.lexsort((is_read, time, unit))  # by unit, then time, a load before a read at its time
    unit, time, is_read = unit[order], time[order], is_read[order]
    # a load is used when the next event of its unit is a read within the horizon, not another load
    load_at = np.flatnonzero(~is_read)
    nxt = np.minimum(load_at + 1, unit.size - 1)
    used = (load_at + 1 < unit.size) & is_read[nxt] & (unit[nxt] == unit[load_at]) & \
        (time[nxt] <= time[load_at] + horizon)
    out = np.zeros(n, dtype=bool)
    out[order[load_at]] = used
    return out


class Loads:
    """The units each cycle's new pins loaded, with the cycle's trace time."""

    def __init__(self) -> None:
        self._times: list[NDArray[np.float64]] = []
        self._units: list[NDArray[np.int64]] = []

    def add(self, now: float, units: list[int]) -> None:
        if units:
            self._units.append(np.asarray(units, dtype=np.int64))
            self._times.append(np.full(len(units), now, dtype=np.float64))

    def __len__(self) -> int:
        return sum(u.size for u in self._units)

    def arrays(self) -> tuple[NDArray[np.float64], NDArray[np.int64]]:
        """Every load's time and unit, in the order they were added."""
        if not self._units:
            return np.zeros(0), np.zeros(0, dtype=np.int64)
        return np.concatenate(self._times), np.concatenate(self._units)

    def used(self, bt: BlockTrace, horizon: float = HORIZON) -> NDArray[np.bool_]:
        """Per load, in order: read by the guest within ``horizon`` seconds (:func:`read_within`)."""
        times, units = self.arrays()
        return read_within(bt, times, units, horizon)
