"""How much of its budget an agent pins this cycle: memory-pressure back-off and cap proration.

Pure arithmetic (no I/O); the agent's :class:`~vmcache.service.budget.Budget`
feeds it the PSI level it read and the ledger's grant.

- Under memory pressure (PSI ``some avg10`` over the threshold) the share of
  the budget halves every cycle, down to :data:`MIN_SHARE`, then to nothing;
  once PSI falls under half the threshold it doubles back (from at least
  :data:`MIN_SHARE`) up to the whole budget. The gap between the two levels
  keeps the share from flapping around one threshold.
- When the host-wide cap grants less than the domain wants, every disk gets
  the same fraction of its own budget.
"""

from __future__ import annotations

__all__ = ["MIN_SHARE", "next_share", "prorate"]

#: Smallest budget share under PSI pressure before it drops to nothing.
MIN_SHARE = 1 / 8


def next_share(share: float, level: float, threshold: float) -> float:
    """The budget share after a cycle at PSI ``level`` (%) against ``threshold`` (%)."""
    if level > threshold:
        return 0.0 if share <= MIN_SHARE else share / 2
    if level < threshold / 2 and share < 1.0:
        return min(1.0, max(MIN_SHARE, share * 2))
    return share


def prorate(budget: int, share: float, want: int, granted: int) -> int:
    """One disk's bytes this cycle: its ``budget`` times ``share``, scaled by ``granted / want``.

    ``want`` is the domain's total (every disk's budget times ``share``) and
    ``granted`` what the host-wide cap let it have of that.
    """
    mine = int(budget * share)
    if granted >= want or want == 0:
        return mine
    return mine * granted // want
