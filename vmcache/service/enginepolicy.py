"""What the host config says about every disk's engine: the memory it may pin into, how pins are filled.

One :class:`EnginePolicy` per agent, built by the composition root
(:mod:`vmcache.service.app`) and handed through each
:class:`~vmcache.service.diskworker.DiskWorker` to its
:class:`~vmcache.service.engine.DiskEngine` unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..host.warmpool import WarmPool

__all__ = ["EnginePolicy"]


@dataclass(frozen=True)
class EnginePolicy:
    """The limits and fill of one agent's pins; every field but ``floor_bytes`` defaults to "not limited"."""

    floor_bytes: int
    """MemAvailable that new pins never take the host under (pins are released while it is under)."""
    room: Callable[..., int | None] | None = None
    """The bytes the limited memory cgroups the pins are charged to can still take
    (:meth:`vmcache.host.memcg.MemcgRoom.room`; the pinner holds to it as to the floor); None: not looked at."""
    apart: Callable[[], bool] | None = None
    """Whether QEMU is under a memory limit the agent is not (:meth:`vmcache.host.memcg.MemcgRoom.apart`):
    then pins are read in, and charged, by the agent (host/pinner.py)."""
    pressure: Callable[[], tuple[int, int]] | None = None
    """The page cache the pins press on: its file refaults so far and its size in bytes
    (:meth:`vmcache.host.memcg.MemcgRoom.pressure`; what the pins cost is judged by it); None: not looked at."""
    prefetch_rate: int | None = None
    """Bytes per second new pins may read from the device (their pages not yet cached); None: no limit."""
    warm_rate: int | None = None
    """The rate instead while a saved hot set is restored (the higher of the two applies); None: the same."""
    warm_pool: WarmPool | None = None
    """The host's warm-up budget, shared with the other agents: restores are paid from it instead of at
    ``warm_rate`` each (None: each disk restores at ``warm_rate``)."""
    domain: str = ""
    """The domain whose disks these are (the owner of their asks of the warm-up budget)."""
    fill: bool = True
    """False: pins lock only the pages cached (the guest's) and read nothing but to restore a saved hot set."""
    decide_on_reads: bool = False
    """The guest's counted reads replace the inference in the model (``read_model: counted``); False: they
    are only reported."""
