"""HeatmapData: the per-block state of one disk a heat map shows (a data type: numpy only)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import numpy as np

__all__ = ["HeatmapData", "pinned_regions"]


@dataclass(frozen=True)
class HeatmapData:
    """Per-block state of one disk (arrays of ``ceil(image_size / block_size)`` entries).

    ``resident`` is the fraction of each block in the page cache *not* by
    vmcache's hand (guest-loaded); ``written`` the fraction written
    recently; ``pinned`` whether vmcache holds the block; ``heat`` the
    model's heat (any non-negative scale); ``read`` the fraction of each
    block the guest read recently, where its reads are counted in the
    kernel (None: not counted). ``when`` is printed as given.
    Raises ValueError when the arrays do not match the image.
    """

    heat: np.ndarray
    pinned: np.ndarray
    resident: np.ndarray
    written: np.ndarray
    block_size: int
    image_size: int
    disk: str
    title: str = ""
    image: str = ""
    when: datetime | None = None
    read: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.image_size < 0:
            raise ValueError(f"bad block_size {self.block_size} or image_size {self.image_size}")
        n = self.nblocks
        for name in ("heat", "pinned", "resident", "written", "read"):
            if getattr(self, name) is None:
                continue
            arr = np.asarray(getattr(self, name))
            if arr.shape != (n,):
                raise ValueError(f"{name} has shape {arr.shape}, expected ({n},) for "
                                 f"{self.image_size} bytes in blocks of {self.block_size}")
            dtype = bool if name == "pinned" else np.float32
            object.__setattr__(self, name, arr.astype(dtype, copy=False))
        if not np.all(np.isfinite(self.heat)) or np.any(self.heat < 0):
            raise ValueError("heat must be finite and non-negative")

    @property
    def nblocks(self) -> int:
        return -(-self.image_size // self.block_size)


def pinned_regions(data: HeatmapData) -> list[tuple[int, int]]:
    """Maximal runs of pinned blocks as ``(start, length)`` bytes, clipped to the image."""
    p = np.concatenate(([False], data.pinned, [False])).astype(np.int8)
    edges = np.flatnonzero(np.diff(p))
    out = []
    for a, b in zip(edges[::2], edges[1::2]):
        start = int(a) * data.block_size
        out.append((start, min(int(b) * data.block_size, data.image_size) - start))
    return out
