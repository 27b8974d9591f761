"""What a replayed policy cost at the device, and its hit ratios (pure).

The headline is **device reads per guest request**: the accesses that
missed and had to read the device - read misses, and partial-page writes
to uncached units (:mod:`vmcache.replay.accesses`) - over the trace's
requests. Under ``cache='writethrough'`` that is what a cache saves: a
write goes to the device whatever is cached, so a write "hit" saves
nothing, and an all-access hit ratio flatters a policy that keeps written
data nobody reads back. Beside it the read hit ratio (read hits over read
accesses), and, secondary, the hit ratio over all accesses.

Loads a policy makes off the guest's I/O path (vmcache pinning a region
before the guest reads it) are not misses; the vmcache arms report them
beside the figures (:func:`loads_extra`): how many (``prefetched_blocks``,
``loaded_per_request``) and the share the guest read within two minutes
(``loaded_read_share``, :mod:`vmcache.replay.loads`) - device reads that
bought nothing where it is low.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .accesses import BlockTrace

__all__ = ["PolicyResult", "loads_extra", "measure"]


@dataclass(frozen=True)
class PolicyResult:
    """How one policy did at one memory size (``budget`` bytes)."""

    policy: str
    budget: int
    requests: int
    accesses: int
    hits: int
    read_accesses: int
    read_hits: int
    device_reads: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def reads_per_request(self) -> float:
        """Device reads per guest request: the headline (lower is better)."""
        return self.device_reads / self.requests if self.requests else 0.0

    @property
    def hit_ratio(self) -> float:
        """Hits over all accesses, reads and writes (secondary: a write hit saves nothing)."""
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def read_hit_ratio(self) -> float:
        return self.read_hits / self.read_accesses if self.read_accesses else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"policy": self.policy, "budget_bytes": self.budget, "requests": self.requests,
                "device_reads": self.device_reads, "reads_per_request": round(self.reads_per_request, 6),
                "read_accesses": self.read_accesses, "read_hits": self.read_hits,
                "read_hit_ratio": round(self.read_hit_ratio, 6), "accesses": self.accesses, "hits": self.hits,
                "hit_ratio": round(self.hit_ratio, 6), **self.extra}


def measure(name: str, budget: int, bt: BlockTrace, hit: NDArray[np.bool_], *, head: float | None = None,
            select: NDArray[np.bool_] | None = None, **extra: Any) -> PolicyResult:
    """The figures of a policy that hit (True) or missed each access of ``bt``.

    ``select``: only these accesses (one VM's in host mode); ``head``: also
    the device reads per request and the read hit ratio over the first
    ``head`` seconds (``head_reads_per_request``, ``head_read_hit_ratio``).
    """
    keep = np.ones(len(bt), dtype=bool) if select is None else select
    reads = ~bt.write & keep
    hit = hit & keep
    dev = bt.costly & ~hit & keep
    if head is not None and len(bt):
        first = keep & (bt.time < bt.time[0] + head)
        requests = bt.requests(first)
        first_reads = int((reads & first).sum())
        extra["head_reads_per_request"] = round(int(dev[first].sum()) / requests, 6) if requests else 0.0
        extra["head_read_hit_ratio"] = round(int((hit & reads & first).sum()) / first_reads, 6) if first_reads else 0.0
    return PolicyResult(name, budget, bt.requests(select), int(keep.sum()), int(hit.sum()), int(reads.sum()),
                        int((hit & reads).sum()), int(dev.sum()), dict(extra))


def loads_extra(used: NDArray[np.bool_], requests: int) -> dict[str, Any]:
    """The figures of a vmcache arm's loads (``used``: per load, read within the horizon) over ``requests``."""
    loaded = int(used.size)
    return {"loaded_units": loaded, "loaded_per_request": round(loaded / requests, 6) if requests else 0.0,
            "loaded_read_share": round(int(used.sum()) / loaded, 6) if loaded else 0.0}
