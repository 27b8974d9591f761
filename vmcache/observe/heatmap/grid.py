"""Where blocks go in the picture and what colour each cell is (pure: numpy in, RGB array out).

The picture uses the vmdisktouch paper's palette, one colour channel per
fact about a stretch of the image: blue pinned by vmcache; green in the
page cache, loaded by the guest (or anything but vmcache) - or, where the
kernel counts the guest's reads, read by the guest recently, so reads and
writes show apart; red written by the guest recently; brightness the
heat; dark grey neither. Colours mix (pinned and written is magenta,
green and written is yellow).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from .data import HeatmapData

__all__ = ["RenderOptions", "Layout", "layout", "cell_values", "cell_colours",
           "PAGE", "INK", "FAINT", "EMPTY_COLD", "EMPTY_WARM", "MIN_BRIGHTNESS"]

PAGE = (255, 255, 255)        # page background, also cells past the end of the image
INK = (20, 20, 20)
FAINT = (110, 110, 110)
EMPTY_COLD = 36               # grey level of an uncached, cold cell ...
EMPTY_WARM = 92               # ... and of an uncached cell at full heat
MIN_BRIGHTNESS = 0.38         # a coloured cell at zero heat is still clearly coloured


@dataclass(frozen=True)
class RenderOptions:
    """How to draw: ``blocks_per_pixel`` (None: fit the image), map ``aspect``
    (width / height), ``scale`` screen pixels per cell (None: fill
    ``max_width``), ``heat_scale`` the heat drawn at full brightness (None:
    the highest heat in the map), ``legend`` below the map."""

    blocks_per_pixel: int | None = None
    aspect: float = 2.0
    scale: int | None = None
    max_width: int = 1024
    max_height: int = 768
    heat_scale: float | None = None
    legend: bool = True

    def __post_init__(self) -> None:
        if self.blocks_per_pixel is not None and self.blocks_per_pixel < 1:
            raise ValueError("blocks_per_pixel must be at least 1")
        if not (self.aspect > 0 and math.isfinite(self.aspect)):
            raise ValueError("aspect must be a positive number")
        if self.scale is not None and self.scale < 1:
            raise ValueError("scale must be at least 1")
        if self.max_width < 64 or self.max_height < 16:
            raise ValueError("max_width/max_height too small")


@dataclass(frozen=True)
class Layout:
    """Where blocks go: ``cols`` x ``rows`` cells of ``blocks_per_cell`` blocks, ``scale`` px each."""

    blocks_per_cell: int
    cols: int
    rows: int
    scale: int
    row_bytes: int = field(default=0)

    def cell_of(self, block: int) -> tuple[int, int]:
        """(column, row) of the cell holding ``block``."""
        cell = block // self.blocks_per_cell
        return cell % self.cols, cell // self.cols


def layout(nblocks: int, block_size: int, options: RenderOptions = RenderOptions()) -> Layout:
    """Wrap ``nblocks`` into rows of ``2^k`` or ``3 * 2^k`` cells, as near ``options.aspect`` as that allows."""
    max_cells_wide = options.max_width // (options.scale or 2)
    bpc = options.blocks_per_pixel
    if bpc is None:
        budget = max(1, int(max_cells_wide * max_cells_wide / options.aspect))
        bpc = 1 << max(0, math.ceil(math.log2(max(1, nblocks) / budget)))
    ncells = max(1, -(-nblocks // bpc))
    widest = max(1, min(ncells, options.max_width // (options.scale or 1)))
    # Columns of 2^k or 3 * 2^k cells: rows start at round offsets, and the
    # shape can come within a factor 1.5 of any aspect.
    candidates = sorted({c for k in range(31) for c in (1 << k, 3 << k) if c <= widest}) or [1]

    def misfit(c: int) -> float:
        return abs(math.log(c / -(-ncells // c) / options.aspect))

    cols = min(candidates, key=lambda c: (misfit(c), -c))
    rows = -(-ncells // cols)
    scale = options.scale or max(1, min(32, options.max_width // cols, options.max_height // rows))
    return Layout(bpc, cols, rows, scale, cols * bpc * block_size)


def cell_values(data: HeatmapData, lay: Layout) -> dict[str, np.ndarray]:
    """Per-cell aggregates (heat: max, fractions: mean over the blocks present), NaN past the end."""
    total = lay.cols * lay.rows * lay.blocks_per_cell
    out = {}
    layers: list[tuple[str, np.ndarray, Callable[..., np.ndarray]]] = [
        ("heat", data.heat, np.nanmax), ("pinned", data.pinned, np.nanmean),
        ("resident", data.resident, np.nanmean), ("written", data.written, np.nanmax)]
    if data.read is not None:
        layers.append(("read", data.read, np.nanmax))
    for name, arr, how in layers:
        padded = np.full(total, np.nan, dtype=np.float32)
        padded[: data.nblocks] = arr
        grid = padded.reshape(lay.rows, lay.cols, lay.blocks_per_cell)
        with np.errstate(all="ignore"), _no_empty_slice_warning():
            out[name] = how(grid, axis=2)
    return out


@contextlib.contextmanager
def _no_empty_slice_warning() -> Iterator[None]:
    # nanmax/nanmean of a cell past the end of the image (all NaN) warns; NaN is what we want.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def cell_colours(data: HeatmapData, lay: Layout, heat_scale: float | None = None) -> np.ndarray:
    """RGB uint8 array (rows, cols, 3) of the map, one entry per cell."""
    c = cell_values(data, lay)
    top = heat_scale if heat_scale else float(np.nanmax(c["heat"])) if data.nblocks else 0.0
    heat = np.nan_to_num(c["heat"], nan=0.0)
    level = np.sqrt(np.clip(heat / top, 0.0, 1.0)) if top > 0 else np.zeros_like(heat)

    def strength(frac: np.ndarray) -> np.ndarray:
        f = np.nan_to_num(frac, nan=0.0)
        return np.where(f > 0, 0.5 + 0.5 * np.clip(f, 0, 1), 0.0)

    green = c["read"] if "read" in c else c["resident"]
    rgb = np.stack([strength(c["written"]), strength(green), strength(c["pinned"])], axis=-1)
    peak = rgb.max(axis=-1, keepdims=True)
    coloured = peak[..., 0] > 0
    hue = np.divide(rgb, peak, out=np.zeros_like(rgb), where=peak > 0)
    bright = MIN_BRIGHTNESS + (1 - MIN_BRIGHTNESS) * level
    pixels = np.empty(rgb.shape, dtype=np.float32)
    pixels[:] = (EMPTY_COLD + (EMPTY_WARM - EMPTY_COLD) * level)[..., None]
    pixels[coloured] = hue[coloured] * bright[coloured][:, None] * 255
    pixels[np.isnan(c["heat"])] = PAGE
    return np.clip(np.rint(pixels), 0, 255).astype(np.uint8)
