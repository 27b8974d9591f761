"""The host's warm-up budget divided between the disks restoring a saved hot set at once (pure).

After a host reboot every VM starts within seconds and every agent would
read its saved set back at once, while the guests boot and read the same
device. So the bytes per second of warm-up reads are one budget per
backing device (vmcache.host.warmpool keeps its tokens), and the disks
waiting for it take turns by what their guests will wait for first: the
densest saved region first (its mean heat per block - the share of its
bytes the guest kept reading - the unit the host cap is divided in,
vmcache.model.share). An ask older than ``fresh`` seconds is an agent's
that stopped asking: it holds nothing back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["WarmAsk", "warm_grant"]


@dataclass(frozen=True)
class WarmAsk:
    """What one disk asked of the warm-up budget: ``want`` bytes, ``priority`` (density), at ``at`` (s)."""

    want: int
    priority: float
    at: float


def warm_grant(tokens: float, asks: Mapping[str, WarmAsk], me: str, now: float, fresh: float) -> int:
    """The bytes of ``tokens`` that ``me`` may read now: what is left once the fresh asks ahead of it -
    higher priority, ties by name - are served. Raises KeyError when ``me`` has not asked."""
    mine = asks[me]
    rank = (-mine.priority, me)
    ahead = sum(a.want for who, a in asks.items()
                if who != me and now - a.at <= fresh and (-a.priority, who) < rank)
    return int(max(0.0, min(float(mine.want), tokens - ahead)))
