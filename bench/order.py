"""The order a harness runs its arms in within a round: rotated from round to round.

The project's benchmark standard: arms run interleaved, in an order that
changes from round to round, so that no arm always runs first (right after
set-up, a device check or a cold start) or always after the same neighbour.
Round ``r`` (1-based) starts at arm ``(r - 1) mod n`` and wraps around, so
over ``n`` rounds every arm takes every place once. Deterministic: the
order of a round follows from its number, and the harnesses log it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def round_order(items: Sequence[T], round_: int) -> list[T]:
    """``items`` in the order round ``round_`` (1-based) runs them: from item ``(round_ - 1) mod n`` on, wrapping."""
    if not items:
        return []
    k = (round_ - 1) % len(items)
    return [*items[k:], *items[:k]]
