"""The host's warm-up budget divided between the disks restoring a saved hot set at once (pure).

After a host reboot every VM starts within seconds and every agent would
read its saved set back at once, while the guests boot and read the same
device. So the bytes per second of warm-up reads are one budget per
backing device (:class:`DeviceBudget`: its tokens and the disks' asks;
vmcache.host.warmpool keeps it in a file the agents share, the replay's
host mode in memory), and the disks waiting for it take turns by what
their guests will wait for first: the densest saved region first
(:func:`warm_ask`: its mean heat per block - the share of its bytes the
guest kept reading - the unit the host cap is divided in,
vmcache.model.share). An ask older than ``fresh`` seconds is an agent's
that stopped asking: it holds nothing back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .params import ModelParams
from .warm import WarmStart

__all__ = ["DeviceBudget", "WarmAsk", "warm_ask", "warm_grant"]


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


def warm_ask(warm: WarmStart | None, params: ModelParams, rate: float) -> tuple[int, float] | None:
    """What a disk restoring ``warm`` asks of a budget of ``rate`` bytes per second before a cycle:
    ``(want, density)`` - at most one interval's worth, no more than the set still to restore, at the
    mean heat per block of its next region (normalised by the read amplitude); None: nothing to restore."""
    if warm is None or warm.done:
        return None
    pending = warm.held()
    if not pending:
        return None
    first = pending[0]
    bs = params.block_size
    blocks = max(1, -(-first.end // bs) - first.start // bs)
    density = first.priority / blocks / (params.read_amplitude or params.write_amplitude or 1.0)
    want = min(int(rate * params.interval), max(0, warm.total_bytes - warm.restored_bytes))
    return want, density


@dataclass
class DeviceBudget:
    """One backing device's warm-up budget: ``tokens`` (bytes) as of ``at`` (s), and the disks' asks.

    It fills at ``rate`` bytes per second and holds at most ``burst``
    seconds' worth; an ask not renewed for ``2 * burst`` seconds (its agent
    stopped) is dropped.
    """

    tokens: float
    at: float
    asks: dict[str, WarmAsk] = field(default_factory=dict)

    @classmethod
    def full(cls, rate: float, burst: float, now: float) -> DeviceBudget:
        """A budget never drawn on: one burst's worth."""
        return cls(rate * burst, now)

    def take(self, who: str, want: int, priority: float, now: float, *, rate: float, burst: float) -> int:
        """``who`` asks for ``want`` bytes at ``priority``: the bytes granted (taken now). What it did not
        get stays asked for, ahead of less dense disks, until it asks again."""
        self.tokens = min(rate * burst, self.tokens + rate * max(0.0, now - self.at))
        self.at = now
        asks = {k: a for k, a in self.asks.items() if now - a.at <= 2 * burst}
        asks[who] = WarmAsk(max(0, want), priority, now)
        granted = warm_grant(self.tokens, asks, who, now, fresh=2 * burst)
        self.tokens -= granted
        left = asks[who].want - granted
        if left > 0:
            asks[who] = WarmAsk(left, priority, now)
        else:
            del asks[who]
        self.asks = asks
        return granted

    def give_back(self, who: str, unused: int, *, rate: float, burst: float) -> None:
        """Return bytes ``who`` took but did not read: it wanted less than it asked, so its ask waits no more."""
        if unused <= 0:
            return
        self.tokens = min(rate * burst, self.tokens + unused)
        self.asks.pop(who, None)
