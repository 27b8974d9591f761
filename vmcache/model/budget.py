"""How much of its budget an agent pins this cycle: memory-pressure back-off and cap proration.

Pure arithmetic (no I/O); the agent's :class:`~vmcache.service.budget.Budget`
feeds it the PSI level it read and the ledger's grant.

- Under memory pressure (PSI ``some avg10`` over the threshold) the share of
  the budget halves every cycle, down to :data:`MIN_SHARE`, then to nothing;
  once PSI falls under half the threshold it doubles back (from at least
  :data:`MIN_SHARE`) up to the whole budget. The gap between the two levels
  keeps the share from flapping around one threshold.
- When the host-wide cap grants less than the domain wants, the grant is
  divided between the domain's disks by the same rule as the cap between
  domains (vmcache.model.share: densest bytes first, each disk within its
  budget) once the disks published demand curves; before that (the first
  cycle) every disk gets the same fraction of its own budget.
"""

from __future__ import annotations

from collections.abc import Mapping

from .share import Curve, Demand, merge_curves, split_budget

__all__ = ["MIN_SHARE", "next_share", "prorate", "divide_disks", "domain_curve"]

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


def divide_disks(budgets: Mapping[str, int], share: float, granted: int,
                 curves: Mapping[str, Curve]) -> dict[str, int]:
    """Each disk's bytes this cycle out of the domain's ``granted`` bytes.

    ``budgets``: each disk's own budget, ``share``: the PSI share of it;
    ``curves``: each disk's demand curve of the previous cycle. With no
    curve at all (first cycle), :func:`prorate`; else the grant goes to the
    densest bytes of all disks, each within ``budget * share``.
    """
    want = sum(int(b * share) for b in budgets.values())
    if not any(curves.get(d) for d in budgets):
        return {d: prorate(b, share, want, granted) for d, b in budgets.items()}
    disks = {d: Demand(budget=int(b * share), curve=curves.get(d, ())) for d, b in budgets.items()}
    return split_budget(min(granted, want), disks)


def domain_curve(budgets: Mapping[str, int], share: float, curves: Mapping[str, Curve]) -> Curve:
    """The domain's demand curve: its disks' curves merged, each cut at its ``budget * share``."""
    return merge_curves(_cut_at(curves.get(d, ()), int(b * share)) for d, b in budgets.items())


def _cut_at(curve: Curve, limit: int) -> Curve:
    """``curve`` up to ``limit`` bytes (the last step cut proportionally)."""
    out: list[tuple[int, float]] = []
    prev_b, prev_v = 0, 0.0
    for b, v in curve:
        if b >= limit:
            if limit > prev_b:
                out.append((limit, prev_v + (v - prev_v) * (limit - prev_b) / (b - prev_b)))
            break
        out.append((b, v))
        prev_b, prev_v = b, v
    return tuple(out)
