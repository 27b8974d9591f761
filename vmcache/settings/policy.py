"""Which disks of a domain vmcache manages, and with what budget (pure).

Combines the host config (eligible cache modes, default budget) with a
domain's metadata and disks. The agent logs and shows in ``vmcache status``
the ``reason`` of every disk it leaves alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .config import NEVER_ELIGIBLE, HostConfig
from .metadata import DiskInfo, DomainSettings

__all__ = ["DiskChoice", "choose_disks", "domain_budget", "domain_minimum", "total_budget"]


@dataclass(frozen=True)
class DiskChoice:
    """A disk and vmcache's decision about it; ``budget`` is 0 for skipped disks.

    ``shared``: the budget is the rest of the domain's, which every disk
    without a budget of its own may take as a whole (not a share of it).
    """

    disk: DiskInfo
    eligible: bool
    reason: str | None
    budget: int
    shared: bool = False


def domain_budget(settings: DomainSettings, host: HostConfig) -> int:
    """The domain's byte budget: its metadata's, else the host default."""
    return settings.budget if settings.budget is not None else host.budget


def domain_minimum(settings: DomainSettings, host: HostConfig) -> int:
    """The domain's guaranteed share of the host cap: its ``min=``, never above its budget (0 when unset).

    The metadata parser refuses a ``min`` above an explicit ``budget``; one
    above the host's default budget is cut to it here.
    """
    return min(settings.minimum or 0, domain_budget(settings, host))


def _skip_reason(disk: DiskInfo, settings: DomainSettings, host: HostConfig) -> str | None:
    override = settings.disk(disk.target)
    if override is not None and override.exclude:
        return "excluded in metadata"
    if disk.device not in ("disk", "lun"):
        return f"device {disk.device}"
    if disk.source is None:
        return f"no local image (source type {disk.source_type})"
    mode = disk.cache_mode
    if mode in NEVER_ELIGIBLE:
        return f"cache={mode} bypasses the page cache"
    if mode not in host.cache_modes:
        shown = mode if disk.cache else f"default ({mode})"
        return f"cache={shown} not in cache_modes ({', '.join(sorted(host.cache_modes))})"
    return None


def choose_disks(disks: tuple[DiskInfo, ...] | list[DiskInfo], settings: DomainSettings,
                 host: HostConfig) -> list[DiskChoice]:
    """Decide each disk, in XML order.

    Eligible disks with a budget of their own keep it; each other eligible
    disk may take the whole rest of the domain budget (never below 0), and
    together they never more than that (:func:`total_budget`): the rest goes
    to whichever of them is hot, so an idle disk plugged in beside a hot one
    takes nothing from it.
    """
    reasons = [_skip_reason(d, settings, host) for d in disks]
    own = {d.target: o.budget for d in disks if (o := settings.disk(d.target)) and o.budget is not None}
    eligible = [d for d, r in zip(disks, reasons) if r is None]
    rest = max(0, domain_budget(settings, host) - sum(own.get(d.target, 0) for d in eligible))
    choices = []
    for disk, reason in zip(disks, reasons):
        shared = reason is None and disk.target not in own
        budget = 0 if reason else own.get(disk.target, rest)
        choices.append(DiskChoice(disk=disk, eligible=reason is None, reason=reason, budget=budget, shared=shared))
    return choices


def total_budget(choices: Iterable[DiskChoice]) -> int:
    """The most the ``choices`` may pin together: the disks' own budgets, plus the rest the others share once."""
    taken = [c for c in choices if c.eligible]
    return sum(c.budget for c in taken if not c.shared) + max((c.budget for c in taken if c.shared), default=0)
