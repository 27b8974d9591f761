"""A contiguous byte range of an image chosen for pinning (pure)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Region"]


@dataclass(frozen=True, order=True)
class Region:
    """``length`` bytes of the image from ``start``; ``priority`` orders regions (higher first).

    Offsets are image-file offsets, page aligned. Equality and hashing use
    all three fields; compare ``span`` to match ranges regardless of priority.
    """

    start: int
    length: int
    priority: float = 0.0

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def span(self) -> tuple[int, int]:
        return (self.start, self.length)

    def overlap(self, other: Region) -> int:
        """Bytes this region shares with ``other`` (0 when they are apart)."""
        return max(0, min(self.end, other.end) - max(self.start, other.start))
