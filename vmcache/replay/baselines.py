"""The caches vmcache is measured against: LRU, the kernel's own policy, the read-aware optimum, static top-k.

Each takes a :class:`~vmcache.replay.accesses.BlockTrace` and a capacity in
units and returns hit (True) or miss per access, starting empty.

- :func:`lru`: plain LRU.
- :func:`linux`: what a Linux host's page cache does with the image's
  pages (:class:`LinuxCache`, below): the kernel's choice vmcache has to
  beat, and what holds the unpinned rest of the memory in the vmcache arms.
- :func:`belady`: the optimum of caches that load on demand, counting only
  misses that read the device (``costly`` accesses): Belady's MIN on the
  next costly access, allowed not to cache (bypass). No such cache causes
  fewer device reads; vmcache, which may load a region before the guest
  reads it, can.
- :func:`static_topk`: the ``capacity`` units most read over the whole
  trace (known in advance), cached at their first access, never evicted.

:class:`LruCache` and :class:`LinuxCache` are also the *rest* of a vmcache
arm: the memory vmcache does not pin, with ``discard`` (a unit pinned
leaves the lists) and ``release`` (a unit unpinned goes back).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from itertools import chain
from typing import Protocol

import numpy as np
from numpy.typing import NDArray

from .accesses import BlockTrace, next_use

__all__ = ["BASELINES", "Rest", "LruCache", "LinuxCache", "lru", "linux", "belady", "static_topk", "rest_cache"]

SWAP_CLUSTER_MAX = 32
"""Pages the kernel reclaims per round (mm/vmscan.c): how long a refault keeps the active list ageing."""


class Rest(Protocol):
    """The unpinned part of a simulated page cache."""

    capacity: int

    def access(self, unit: int, write: bool) -> bool: ...
    def discard(self, unit: int) -> bool: ...
    def release(self, unit: int) -> None: ...
    def resize(self, capacity: int) -> None: ...
    def __contains__(self, unit: object) -> bool: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[int]: ...


class LruCache:
    """Plain LRU of ``capacity`` units: every access, read or write, makes its unit the most recent."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._units: OrderedDict[int, None] = OrderedDict()

    def access(self, unit: int, write: bool) -> bool:
        """One access; True on a hit. The unit is cached either way (a write lands in the page cache)."""
        units = self._units
        if unit in units:
            units.move_to_end(unit)
            return True
        units[unit] = None
        if len(units) > self.capacity:
            units.popitem(last=False)
        return False

    def discard(self, unit: int) -> bool:
        """Take ``unit`` out (it was pinned); whether it was cached."""
        return self._units.pop(unit, 0) is None

    def release(self, unit: int) -> None:
        """A unit unpinned comes back as the most recent (munlock puts its pages back on the LRU)."""
        self._units[unit] = None
        self._units.move_to_end(unit)

    def resize(self, capacity: int) -> None:
        self.capacity = capacity
        while len(self._units) > max(0, capacity):
            self._units.popitem(last=False)

    def __contains__(self, unit: object) -> bool:
        return unit in self._units

    def __len__(self) -> int:
        return len(self._units)

    def __iter__(self) -> Iterator[int]:
        return iter(self._units)


class LinuxCache:
    """The kernel's page cache for one file's pages, classic active/inactive lists (mm/vmscan.c, mm/workingset.c).

    What it keeps of the kernel (6.x, multi-gen LRU off, as Debian ships
    it; unmapped file pages, no swap):

    - a unit read in comes to the head of the inactive list, referenced (the
      read marks it accessed); a read of an inactive unit that is already
      referenced activates it (head of the active list, referenced
      cleared), else marks it referenced. A read of an active unit marks it
      referenced; nothing moves.
    - writes mark nothing (``FGP_WRITEBEGIN`` has no ``FGP_ACCESSED``): a
      written unit comes in on the inactive list unreferenced, a write to a
      cached unit leaves it where it is, and a written unit never refaults
      into the active list (``filemap_add_folio`` skips
      ``workingset_refault`` for ``__GFP_WRITE``: data being rewritten is
      not working set).
    - reclaim takes the inactive list's tail whatever its referenced bit
      (clean unmapped pages are reclaimed, ``folio_check_references``),
      leaving a shadow entry with the eviction counter; when the inactive
      list is low (``inactive * ratio < active``, ratio ``int_sqrt(10 *
      GiB)`` of the lists, 1 under 1 GiB) the active list's tail goes to
      the inactive head first, its referenced bit kept.
    - refault: a unit read back whose shadow's distance (evictions and
      activations since, ``nonresident_age``) is at most the active list's
      size comes in active (``workingset_test_recent`` without anon
      pages). For ``SWAP_CLUSTER_MAX`` reclaims after a refault activation
      the active list is aged as fast as the inactive one (``may_deactivate``:
      the kernel then scans both lists by the same fraction).

    Simplified: one unit stands for its pages (no large folios, readahead
    or per-batch ``folio_mark_accessed``); the lists are exact LRU order,
    not scanned in batches; shadows are kept for every evicted unit (the
    kernel bounds them by memory; one farther than the lists can ever
    hold never activates anyway).
    """

    def __init__(self, capacity: int, *, unit_bytes: int = 4096) -> None:
        self._unit_bytes = unit_bytes
        self._inactive: OrderedDict[int, bool] = OrderedDict()  # unit -> referenced; first = tail
        self._active: OrderedDict[int, bool] = OrderedDict()
        self._shadow: dict[int, int] = {}
        self._age = 0  # nonresident_age
        self._evictions = 0
        self._deactivate_until = 0
        self._debt = 0.0
        self.capacity = 0
        self._ratio = 1
        self.resize(capacity)

    def access(self, unit: int, write: bool) -> bool:
        """One access; True on a hit."""
        inactive = self._inactive
        referenced = inactive.get(unit)
        if referenced is not None:
            if not write:
                if referenced:
                    del inactive[unit]
                    self._active[unit] = False
                    self._age += 1  # workingset_activation
                else:
                    inactive[unit] = True
            return True
        active = self._active
        if unit in active:
            if not write:
                active[unit] = True
            return True
        shadow = self._shadow.pop(unit, None)
        if not write and shadow is not None and self._age - shadow <= len(active):
            active[unit] = True
            self._age += 1
            self._deactivate_until = self._evictions + SWAP_CLUSTER_MAX
        else:
            inactive[unit] = not write
        self._reclaim()
        return False

    def _reclaim(self) -> None:
        inactive, active = self._inactive, self._active
        while len(inactive) + len(active) > self.capacity:
            if active and (not inactive or len(inactive) * self._ratio < len(active)):
                self._deactivate()
                continue
            unit, _ = inactive.popitem(last=False)
            self._shadow[unit] = self._age
            self._age += 1
            self._evictions += 1
            if self._evictions <= self._deactivate_until and inactive:
                self._debt += len(active) / len(inactive)
                while self._debt >= 1.0 and active:
                    self._deactivate()
                    self._debt -= 1.0

    def _deactivate(self) -> None:
        unit, referenced = self._active.popitem(last=False)
        self._inactive[unit] = referenced

    def mark(self, unit: int) -> bool:
        """A read of a resident ``unit`` from another file descriptor: whether it was resident.

        What a ``pread`` of a cached page does to it (``filemap_read`` calls
        ``folio_mark_accessed``): referenced, or active when it was
        referenced already - two marks activate a written unit. A unit not
        cached is left alone: the reader checks residency first, so a mark
        never reads the device.
        """
        if unit not in self:
            return False
        self.access(unit, False)
        return True

    def refresh(self, units: Iterable[int]) -> None:
        """Each inactive unit of ``units``, in their order, to the inactive head, its referenced bit kept.

        What an ``mlock`` and ``munlock`` of a resident page do to it: mlock
        takes it off its list (active cleared), munlock puts it back at the
        inactive head (``__munlock_folio``). Active and uncached units are
        left alone.
        """
        inactive = self._inactive
        for unit in units:
            referenced = inactive.pop(unit, None)
            if referenced is not None:
                inactive[unit] = referenced

    def inactive_units(self) -> list[int]:
        """The inactive list, tail first."""
        return list(self._inactive)

    def discard(self, unit: int) -> bool:
        """Take ``unit`` off the lists (it was pinned: mlocked pages are unevictable); whether it was cached."""
        self._shadow.pop(unit, None)
        if self._inactive.pop(unit, None) is not None:
            return True
        return self._active.pop(unit, None) is not None

    def release(self, unit: int) -> None:
        """A unit unpinned goes to the inactive head, unreferenced (mlock cleared its active bit)."""
        self._inactive[unit] = False
        self._reclaim()

    def resize(self, capacity: int) -> None:
        self.capacity = max(0, capacity)
        gib = self.capacity * self._unit_bytes >> 30
        self._ratio = math.isqrt(10 * gib) if gib else 1
        self._reclaim()

    @property
    def active_units(self) -> int:
        return len(self._active)

    def is_active(self, unit: int) -> bool:
        return unit in self._active

    def __contains__(self, unit: object) -> bool:
        return unit in self._inactive or unit in self._active

    def __len__(self) -> int:
        return len(self._inactive) + len(self._active)

    def __iter__(self) -> Iterator[int]:
        return chain(self._inactive, self._active)


def rest_cache(name: str, capacity: int, unit_bytes: int) -> Rest:
    """The unpinned rest of a cache: ``lru`` or ``linux``. ValueError for another name."""
    if name == "lru":
        return LruCache(capacity)
    if name == "linux":
        return LinuxCache(capacity, unit_bytes=unit_bytes)
    raise ValueError(f"unknown rest policy {name!r} (lru, linux)")


def _run(bt: BlockTrace, cache: Rest) -> NDArray[np.bool_]:
    hits = bytearray(len(bt))
    access = cache.access
    for i, (unit, write) in enumerate(zip(bt.block.tolist(), bt.write.tolist())):
        hits[i] = access(unit, write)
    return np.frombuffer(bytes(hits), dtype=bool).copy()


def lru(bt: BlockTrace, capacity: int) -> NDArray[np.bool_]:
    """Hit or miss per access for a plain LRU cache of ``capacity`` units."""
    return _run(bt, LruCache(capacity)) if capacity > 0 else np.zeros(len(bt), dtype=bool)


def linux(bt: BlockTrace, capacity: int) -> NDArray[np.bool_]:
    """Hit or miss per access for the kernel's lists (:class:`LinuxCache`) of ``capacity`` units."""
    if capacity <= 0:
        return np.zeros(len(bt), dtype=bool)
    return _run(bt, LinuxCache(capacity, unit_bytes=bt.block_size))


def belady(bt: BlockTrace, capacity: int, *, costly: NDArray[np.bool_] | None = None) -> NDArray[np.bool_]:
    """Hit or miss per access for the optimal demand cache (MIN with bypass) of ``capacity`` units.

    Only misses of ``costly`` accesses count (default ``bt.costly``: reads
    and partial-page writes): keeping a unit until a write that needs no
    read is worth nothing, so it is never kept for that. Every access to a
    cached unit is a hit.
    """
    n = len(bt)
    hits = bytearray(n)
    if capacity <= 0:
        return np.zeros(n, dtype=bool)
    cost = (bt.costly if costly is None else costly).tolist()
    nxt = [j if j < n and cost[j] else n for j in next_use(bt.block).tolist()]
    cache: dict[int, int] = {}  # unit -> index of its next costly use (n: none before a free write or the end)
    heap: list[tuple[int, int]] = []  # (-next use, unit); stale entries skipped lazily
    for i, b in enumerate(bt.block.tolist()):
        nu = nxt[i]
        if b in cache:
            hits[i] = 1
        elif nu == n:
            continue  # worth nothing: not cached
        elif len(cache) >= capacity:
            while cache.get(heap[0][1]) != -heap[0][0]:
                heapq.heappop(heap)
            if -heap[0][0] <= nu:
                continue  # every cached unit is needed again before this one: do not cache it
            del cache[heapq.heappop(heap)[1]]
        if nu == n:
            del cache[b]
            continue
        cache[b] = nu
        heapq.heappush(heap, (-nu, b))
    return np.frombuffer(bytes(hits), dtype=bool).copy()


def static_topk(bt: BlockTrace, capacity: int) -> NDArray[np.bool_]:
    """Hit or miss per access when only the ``capacity`` units read most often are cached (from first use)."""
    if capacity <= 0 or len(bt) == 0:
        return np.zeros(len(bt), dtype=bool)
    units, index = np.unique(bt.block, return_inverse=True)
    counts = np.bincount(index, weights=bt.costly, minlength=units.size)
    chosen = np.zeros(units.size, dtype=bool)
    chosen[np.argsort(-counts, kind="stable")[:capacity]] = True
    first = np.zeros(len(bt), dtype=bool)
    first[np.unique(index, return_index=True)[1]] = True
    hit: NDArray[np.bool_] = chosen[index] & ~first
    return hit


BASELINES: dict[str, Callable[[BlockTrace, int], NDArray[np.bool_]]] = {
    "lru": lru, "linux": linux, "belady": belady, "static": static_topk,
}
