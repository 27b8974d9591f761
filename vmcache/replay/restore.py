"""Two other ways to warm a VM's second run, to measure vmcache's warm start against (pure).

Beside ``warm`` (the second run restarted from the hot set vmcache saved,
:mod:`vmcache.replay.sim`), a second run of the trace may start from what
another restore reads back:

- ``snapshot``: what the cache held at the end of the first run (the
  ``vmcache`` arm's, pinned and not), as a tool that records the page
  cache's residency and reads it back restores it;
- ``most-read``: the memory's worth of units the first run read most: the
  best a restore of what the guest reads most can do (it knows the whole
  first run).

Both are read back before the first access, at once and without device
time (a bound, not a model of the restore's reads), into the kernel's lists
as read-ahead leaves pages there (inactive, not referenced), with the cold
``vmcache`` arm running on top; the units count as its loads.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from .accesses import BlockTrace
from .baselines import Rest

__all__ = ["MOST_READ", "RESTORES", "SNAPSHOT", "most_read", "preload", "restored_units"]

SNAPSHOT = "snapshot"
MOST_READ = "most-read"
RESTORES = (SNAPSHOT, MOST_READ)


def most_read(bt: BlockTrace, capacity: int) -> NDArray[np.int64]:
    """The ``capacity`` units read most often in ``bt`` (ties by unit), the most read last."""
    reads = ~bt.write
    units, count = np.unique(bt.block[reads], return_counts=True)
    chosen = np.lexsort((units, -count))[:max(0, capacity)]
    return units[chosen[::-1]]


def restored_units(name: str, bt: BlockTrace, capacity: int, resident: NDArray[np.int64]) -> NDArray[np.int64]:
    """What restore ``name`` reads back: ``resident`` (the first run's last cache) or :func:`most_read`.

    Raises ValueError for another name.
    """
    if name == SNAPSHOT:
        return resident[-capacity:] if capacity > 0 else resident[:0]
    if name == MOST_READ:
        return most_read(bt, capacity)
    raise ValueError(f"unknown restore {name!r} (known: {', '.join(RESTORES)})")


def preload(rest: Rest, units: NDArray[np.int64]) -> list[int]:
    """Read ``units`` into ``rest`` in their order (the last the most recent); the units that were not cached.

    ``release`` is the lists' operation for it: a page read in off the
    guest's path comes to the inactive head, not referenced.
    """
    loaded = [u for u in units.tolist() if u not in rest]
    for unit in loaded:
        rest.release(unit)
    rest.resize(rest.capacity)  # past the room: the oldest go, as reclaim would take them
    return loaded
