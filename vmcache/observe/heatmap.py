"""Heat-map pictures and JSON of one disk: what vmcache pinned, what the guest loaded and wrote, how hot.

The picture uses the vmdisktouch paper's palette, one colour channel per
fact about a stretch of the image:

- blue: pinned by vmcache;
- green: in the page cache, loaded by the guest (or anything but vmcache);
- red: written by the guest recently (dirty bitmap);
- brightness: heat (the model's decaying score); dark grey: not cached.

Colours mix (pinned and written is magenta, guest-loaded and written is
yellow). The image is laid out as text is: offset 0 at the top left, one
row after the other, each row the same number of bytes; the scale on the
left gives the offset at the start of a row. Rendering is pure (numpy in,
PNG bytes out; the time shown is a parameter); :func:`write_atomic` puts
the bytes in place.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from ..errors import HostError
from ..host.files import write_atomic
from ..units import format_size

__all__ = [
    "HeatmapData",
    "HeatmapWriter",
    "RenderOptions",
    "Layout",
    "layout",
    "render_image",
    "block_pixel",
    "render_png",
    "heatmap_json",
    "heatmap_from_json",
    "heatmap_page",
    "pinned_regions",
    "cell_colours",
    "offset_label",
    "JSON_FORMAT",
]

JSON_FORMAT = "vmcache-heatmap/1"

PAGE = (255, 255, 255)        # page background, also cells past the end of the image
INK = (20, 20, 20)
FAINT = (110, 110, 110)
EMPTY_COLD = 36               # grey level of an uncached, cold cell ...
EMPTY_WARM = 92               # ... and of an uncached cell at full heat
MIN_BRIGHTNESS = 0.38         # a coloured cell at zero heat is still clearly coloured


@dataclass(frozen=True)
class HeatmapData:
    """Per-block state of one disk (arrays of ``ceil(image_size / block_size)`` entries).

    ``resident`` is the fraction of each block in the page cache *not* by
    vmcache's hand (guest-loaded); ``written`` the fraction written
    recently; ``pinned`` whether vmcache holds the block; ``heat`` the
    model's heat (any non-negative scale). ``when`` is printed as given.
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

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.image_size < 0:
            raise ValueError(f"bad block_size {self.block_size} or image_size {self.image_size}")
        n = self.nblocks
        for name in ("heat", "pinned", "resident", "written"):
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


def _cells(data: HeatmapData, lay: Layout) -> dict[str, np.ndarray]:
    """Per-cell aggregates (heat: max, fractions: mean over the blocks present), NaN past the end."""
    total = lay.cols * lay.rows * lay.blocks_per_cell
    out = {}
    for name, arr, how in (("heat", data.heat, np.nanmax), ("pinned", data.pinned, np.nanmean),
                           ("resident", data.resident, np.nanmean), ("written", data.written, np.nanmax)):
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
    c = _cells(data, lay)
    top = heat_scale if heat_scale else float(np.nanmax(c["heat"])) if data.nblocks else 0.0
    heat = np.nan_to_num(c["heat"], nan=0.0)
    level = np.sqrt(np.clip(heat / top, 0.0, 1.0)) if top > 0 else np.zeros_like(heat)

    def strength(frac: np.ndarray) -> np.ndarray:
        f = np.nan_to_num(frac, nan=0.0)
        return np.where(f > 0, 0.5 + 0.5 * np.clip(f, 0, 1), 0.0)

    rgb = np.stack([strength(c["written"]), strength(c["resident"]), strength(c["pinned"])], axis=-1)
    peak = rgb.max(axis=-1, keepdims=True)
    coloured = peak[..., 0] > 0
    hue = np.divide(rgb, peak, out=np.zeros_like(rgb), where=peak > 0)
    bright = MIN_BRIGHTNESS + (1 - MIN_BRIGHTNESS) * level
    pixels = np.empty(rgb.shape, dtype=np.float32)
    pixels[:] = (EMPTY_COLD + (EMPTY_WARM - EMPTY_COLD) * level)[..., None]
    pixels[coloured] = hue[coloured] * bright[coloured][:, None] * 255
    pixels[np.isnan(c["heat"])] = PAGE
    return np.clip(np.rint(pixels), 0, 255).astype(np.uint8)


@lru_cache(maxsize=8)
def _font(size: int, bold: bool = False) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    name = "DejaVuSans-Bold.ttf" if bold else "DejaVuSans.ttf"
    for path in (f"/usr/share/fonts/truetype/dejavu/{name}", name):
        try:
            return ImageFont.truetype(path, size)
        except OSError:
            continue
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: fixed bitmap font
        return ImageFont.load_default()


def _text_w(draw: ImageDraw.ImageDraw, text: str, font: Any) -> int:
    left, _, right, _ = draw.textbbox((0, 0), text, font=font)
    return int(right - left)


def _legend_items() -> list[tuple[str, tuple[float, float, float] | None]]:
    return [
        ("pinned by vmcache", (0, 0, 1)),
        ("loaded by the guest (or others)", (0, 1, 0)),
        ("written recently by the guest", (1, 0, 0)),
        ("pinned + written", (1, 0, 1)),
        ("guest-loaded + written", (1, 1, 0)),
        ("not in the page cache", None),
    ]


def _summary(data: HeatmapData) -> str:
    bs = data.block_size
    regions = pinned_regions(data)
    pinned = sum(length for _, length in regions)
    guest = float(data.resident.sum()) * bs
    written = float(data.written.sum()) * bs
    return (f"pinned {format_size(pinned)} in {len(regions)} region{'s' if len(regions) != 1 else ''}"
            f"   ·   guest-loaded {format_size(guest)}   ·   written recently {format_size(written)}"
            f"   ·   highest heat {float(data.heat.max()) if data.nblocks else 0:.3g}")


def render_image(data: HeatmapData, options: RenderOptions = RenderOptions()) -> Image.Image:
    """The heat map as a Pillow RGB image: title, offset scale, map, legend."""
    lay = layout(data.nblocks, data.block_size, options)
    cells = cell_colours(data, lay, options.heat_scale)
    mapimg = Image.fromarray(cells, "RGB").resize((lay.cols * lay.scale, lay.rows * lay.scale), Image.NEAREST)

    f_title, f_text, f_small = _font(18, bold=True), _font(13), _font(12)
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    name = " · ".join(p for p in (data.title, f"disk {data.disk}") if p)
    title = f"vmcache heat map — {name}"
    when = data.when.strftime("%Y-%m-%d %H:%M:%S %Z").strip() if data.when else ""
    sub = "   ·   ".join(p for p in (data.image, f"{format_size(data.image_size)} image", when) if p)
    notes = _legend_notes(data, lay) if options.legend else []
    summary = _summary(data) if options.legend else ""
    items = _legend_items() if options.legend else []
    swatch_w = 48
    col_w = max([_text_w(probe, label, f_text) for label, _ in items] + [0]) + swatch_w + 36

    tick_labels = _ticks(data, lay)
    margin = _MARGIN
    map_x, map_y = _map_origin(data, lay)
    text_w = max([_text_w(probe, title, f_title), _text_w(probe, sub, f_text), _text_w(probe, summary, f_text)]
                 + [_text_w(probe, n, f_small) for n in notes])
    width = max(map_x + mapimg.width + margin, 2 * margin + text_w, 2 * margin + 3 * col_w if items else 0)
    legend_h = 16 * len(notes) + 8 + 24 * -(-len(items) // 3) + 28 if options.legend else 0
    height = map_y + mapimg.height + 12 + legend_h
    img = Image.new("RGB", (width, height), PAGE)
    draw = ImageDraw.Draw(img)

    draw.text((margin, 10), title, font=f_title, fill=INK)
    draw.text((margin, 36), sub, font=f_text, fill=FAINT)
    img.paste(mapimg, (map_x, map_y))
    draw.rectangle((map_x - 1, map_y - 1, map_x + mapimg.width, map_y + mapimg.height), outline=FAINT)
    for row, label in tick_labels:
        y = map_y + row * lay.scale
        draw.line((map_x - 6, y, map_x - 2, y), fill=INK)
        draw.text((map_x - 8, y), label, font=f_small, fill=INK, anchor="rm")
    if not options.legend:
        return img

    y = map_y + mapimg.height + 12
    for note in notes:
        draw.text((margin, y), note, font=f_small, fill=FAINT)
        y += 16
    y += 8
    for i, (label, hue) in enumerate(items):
        cx, cy = margin + (i % 3) * col_w, y + (i // 3) * 24
        for k in range(swatch_w):
            level = math.sqrt(k / (swatch_w - 1))
            if hue is None:
                g = int(EMPTY_COLD + (EMPTY_WARM - EMPTY_COLD) * level)
                colour = (g, g, g)
            else:
                v = (MIN_BRIGHTNESS + (1 - MIN_BRIGHTNESS) * level) * 255
                colour = tuple(int(round(c * v)) for c in hue)
            draw.line((cx + k, cy, cx + k, cy + 15), fill=colour)
        draw.rectangle((cx - 1, cy - 1, cx + swatch_w, cy + 16), outline=FAINT)
        draw.text((cx + swatch_w + 8, cy + 8), label, font=f_text, fill=INK, anchor="lm")
    y += 24 * -(-len(items) // 3) + 6
    draw.text((margin, y), summary, font=f_text, fill=INK)
    return img


_MARGIN, _TOP = 16, 68


def _map_origin(data: HeatmapData, lay: Layout) -> tuple[int, int]:
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    axis_w = max([_text_w(probe, t, _font(12)) for _, t in _ticks(data, lay)] + [40]) + 14
    return _MARGIN + axis_w, _TOP


def block_pixel(data: HeatmapData, block: int, options: RenderOptions = RenderOptions()) -> tuple[int, int]:
    """(x, y) of the centre of ``block``'s cell in :func:`render_image`'s picture."""
    if not 0 <= block < data.nblocks:
        raise IndexError(f"block {block} outside 0..{data.nblocks - 1}")
    lay = layout(data.nblocks, data.block_size, options)
    col, row = lay.cell_of(block)
    x0, y0 = _map_origin(data, lay)
    return x0 + col * lay.scale + lay.scale // 2, y0 + row * lay.scale + lay.scale // 2


def _legend_notes(data: HeatmapData, lay: Layout) -> list[str]:
    cell = format_size(lay.blocks_per_cell * data.block_size)
    return [
        f"Read it like text: the disk starts at the top left; each cell is {cell}, each row the next "
        f"{format_size(lay.row_bytes)}; the scale on the left is the offset where a row starts.",
        "Colour says what keeps that part of the disk in memory; brightness is its heat "
        "(dark = cold, bright = hot: what vmcache most wants to keep).",
    ]


def offset_label(offset: int) -> str:
    """An offset the way the scale prints it, exactly: ``0``, ``256MiB``, ``1.25GiB``."""
    if offset == 0:
        return "0"
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        value = offset / size
        if value >= 1 and abs(round(value, 2) - value) < 1e-9:
            return f"{value:.2f}".rstrip("0").rstrip(".") + unit
    return f"{offset}B"


def _ticks(data: HeatmapData, lay: Layout) -> list[tuple[int, str]]:
    """(row, label) pairs: round offsets at least ~34 px apart, and the end of the image."""
    step = 1 << max(0, math.ceil(math.log2(max(1.0, 34 / lay.scale))))
    ticks = [(r, offset_label(r * lay.row_bytes)) for r in range(0, lay.rows, step)]
    end_row = data.image_size / lay.row_bytes if lay.row_bytes else 0
    if lay.rows * lay.scale - (ticks[-1][0] * lay.scale if ticks else 0) >= 34 and end_row == lay.rows:
        ticks.append((lay.rows, offset_label(data.image_size)))
    return ticks


def render_png(data: HeatmapData, options: RenderOptions = RenderOptions()) -> bytes:
    """The heat map as PNG bytes."""
    buf = io.BytesIO()
    render_image(data, options).save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def pinned_regions(data: HeatmapData) -> list[tuple[int, int]]:
    """Maximal runs of pinned blocks as ``(start, length)`` bytes, clipped to the image."""
    p = np.concatenate(([False], data.pinned, [False])).astype(np.int8)
    edges = np.flatnonzero(np.diff(p))
    out = []
    for a, b in zip(edges[::2], edges[1::2]):
        start = int(a) * data.block_size
        out.append((start, min(int(b) * data.block_size, data.image_size) - start))
    return out


def heatmap_json(data: HeatmapData, *, max_buckets: int = 4096, digits: int = 4) -> dict[str, Any]:
    """Regions and per-bucket heat as a JSON-ready dict.

    A bucket is a whole number of blocks (as few as ``max_buckets`` allows):
    ``heat`` and ``written`` are the highest in the bucket, ``pinned`` and
    ``resident`` the mean fraction. ``regions`` are the exact pinned runs.
    """
    bucket_blocks = max(1, -(-data.nblocks // max_buckets))
    nb = -(-data.nblocks // bucket_blocks) if data.nblocks else 0
    lay = Layout(bucket_blocks, max(nb, 1), 1, 1, 0)
    cells = _cells(data, lay) if data.nblocks else {k: np.zeros((1, 0)) for k in ("heat", "pinned", "resident", "written")}

    def values(name: str) -> list[float]:
        return [round(float(v), digits) for v in cells[name][0][:nb]]

    return {
        "format": JSON_FORMAT,
        "title": data.title,
        "disk": data.disk,
        "image": data.image,
        "image_size": data.image_size,
        "block_size": data.block_size,
        "bucket_size": bucket_blocks * data.block_size,
        "time": data.when.isoformat() if data.when else None,
        "regions": [{"start": s, "length": n} for s, n in pinned_regions(data)],
        "buckets": {name: values(name) for name in ("heat", "pinned", "resident", "written")},
    }


def heatmap_from_json(doc: dict[str, Any]) -> HeatmapData:
    """A HeatmapData from :func:`heatmap_json` output, at bucket resolution (a bucket is a block).

    ``pinned`` is true where the bucket was at least half pinned. Raises
    ValueError for another format or inconsistent lengths.
    """
    if doc.get("format") != JSON_FORMAT:
        raise ValueError(f"not a {JSON_FORMAT} document")
    b = doc["buckets"]
    return HeatmapData(
        heat=np.array(b["heat"], dtype=np.float32),
        pinned=np.array(b["pinned"], dtype=np.float32) >= 0.5,
        resident=np.array(b["resident"], dtype=np.float32),
        written=np.array(b["written"], dtype=np.float32),
        block_size=int(doc["bucket_size"]),
        image_size=int(doc["image_size"]),
        disk=str(doc["disk"]),
        title=str(doc.get("title", "")),
        image=str(doc.get("image", "")),
        when=datetime.fromisoformat(doc["time"]) if doc.get("time") else None,
    )


class HeatmapWriter:
    """Writes a disk's heat map every ``every`` cycles (PNG and/or JSON), for the agent loop.

    ``make_data`` is called only on the cycles that write, so building the
    arrays costs nothing in between. Raises HostError from the writes.
    """

    def __init__(self, png_path: str | os.PathLike[str] | None, *, json_path: str | os.PathLike[str] | None = None,
                 every: int = 1, options: RenderOptions = RenderOptions()) -> None:
        if every < 1:
            raise ValueError("every must be at least 1")
        self.png_path = png_path
        self.json_path = json_path
        self.every = every
        self.options = options
        self._cycles = 0

    def cycle(self, make_data: Callable[[], HeatmapData]) -> bool:
        """Count one cycle; on every ``every``-th, write the files. True when it wrote."""
        self._cycles += 1
        if self._cycles % self.every or (self.png_path is None and self.json_path is None):
            return False
        data = make_data()
        if self.png_path is not None:
            write_atomic(self.png_path, render_png(data, self.options), what="heat map")
        if self.json_path is not None:
            write_atomic(self.json_path, json.dumps(heatmap_json(data)).encode() + b"\n", what="heat map")
        return True


def heatmap_page(path: str, lookup: Callable[[str], HeatmapData | None],
                 options: RenderOptions = RenderOptions()) -> tuple[str, bytes] | None:
    """Serve ``/heatmap/<disk>.png`` or ``/heatmap/<disk>.json`` from ``lookup(disk)``.

    For :func:`vmcache.observe.exporter.serve_metrics`'s ``pages``: returns
    ``(content_type, body)``, or None (404) for another path or a disk
    ``lookup`` does not know.
    """
    prefix, _, name = path.rpartition("/")
    disk, dot, kind = name.rpartition(".")
    if prefix != "/heatmap" or not dot or kind not in ("png", "json"):
        return None
    data = lookup(disk)
    if data is None:
        return None
    if kind == "png":
        return "image/png", render_png(data, options)
    return "application/json", json.dumps(heatmap_json(data)).encode() + b"\n"
