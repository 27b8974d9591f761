"""Drawing a heat map with Pillow: title, offset scale, the map, legend; PNG bytes out.

The image is laid out as text is: offset 0 at the top left, one row after
the other, each row the same number of bytes; the scale on the left gives
the offset at the start of a row. Pure apart from Pillow (the time shown is
a field of the data).
"""

from __future__ import annotations

import io
import math
from functools import lru_cache
from typing import Any

from PIL import Image, ImageDraw, ImageFont

from ...units import format_size
from .data import HeatmapData, pinned_regions
from .grid import EMPTY_COLD, EMPTY_WARM, FAINT, INK, MIN_BRIGHTNESS, PAGE, Layout, RenderOptions, cell_colours, layout

__all__ = ["render_image", "render_png", "block_pixel", "offset_label"]


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


def _legend_items(reads: bool) -> list[tuple[str, tuple[float, float, float] | None]]:
    if reads:  # the kernel counts the guest's reads: green is what it read, not what is cached
        return [("pinned by vmcache", (0, 0, 1)), ("read recently by the guest", (0, 1, 0)),
                ("written recently by the guest", (1, 0, 0)), ("pinned + written", (1, 0, 1)),
                ("read + written", (1, 1, 0)), ("neither (not pinned)", None)]
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
    read = f"   ·   read recently {format_size(float(data.read.sum()) * bs)}" if data.read is not None else ""
    return (f"pinned {format_size(pinned)} in {len(regions)} region{'s' if len(regions) != 1 else ''}"
            f"   ·   guest-loaded {format_size(guest)}{read}   ·   written recently {format_size(written)}"
            f"   ·   highest heat {float(data.heat.max()) if data.nblocks else 0:.3g}")


def render_image(data: HeatmapData, options: RenderOptions = RenderOptions()) -> Image.Image:
    """The heat map as a Pillow RGB image: title, offset scale, map, legend."""
    lay = layout(data.nblocks, data.block_size, options)
    cells = cell_colours(data, lay, options.heat_scale)
    mapimg = Image.fromarray(cells, "RGB").resize((lay.cols * lay.scale, lay.rows * lay.scale),
                                                      Image.Resampling.NEAREST)

    f_title, f_text, f_small = _font(18, bold=True), _font(13), _font(12)
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    name = " · ".join(p for p in (data.title, f"disk {data.disk}") if p)
    title = f"vmcache heat map — {name}"
    when = data.when.strftime("%Y-%m-%d %H:%M:%S %Z").strip() if data.when else ""
    sub = "   ·   ".join(p for p in (data.image, f"{format_size(data.image_size)} image", when) if p)
    notes = _legend_notes(data, lay) if options.legend else []
    summary = _summary(data) if options.legend else ""
    items = _legend_items(data.read is not None) if options.legend else []
    col_w = max([_text_w(probe, label, f_text) for label, _ in items] + [0]) + _SWATCH_W + 36

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

    _draw_legend(draw, map_y + mapimg.height + 12, notes, items, summary, col_w)
    return img


_SWATCH_W = 48


def _draw_legend(draw: ImageDraw.ImageDraw, y: int, notes: list[str],
                 items: list[tuple[str, tuple[float, float, float] | None]], summary: str, col_w: int) -> None:
    """Notes, colour swatches (three per row, dark to bright) and the summary line, from ``y`` down."""
    f_text, f_small = _font(13), _font(12)
    for note in notes:
        draw.text((_MARGIN, y), note, font=f_small, fill=FAINT)
        y += 16
    y += 8
    for i, (label, hue) in enumerate(items):
        cx, cy = _MARGIN + (i % 3) * col_w, y + (i // 3) * 24
        for k in range(_SWATCH_W):
            level = math.sqrt(k / (_SWATCH_W - 1))
            colour: tuple[int, ...]
            if hue is None:
                g = int(EMPTY_COLD + (EMPTY_WARM - EMPTY_COLD) * level)
                colour = (g, g, g)
            else:
                v = (MIN_BRIGHTNESS + (1 - MIN_BRIGHTNESS) * level) * 255
                colour = tuple(int(round(c * v)) for c in hue)
            draw.line((cx + k, cy, cx + k, cy + 15), fill=colour)
        draw.rectangle((cx - 1, cy - 1, cx + _SWATCH_W, cy + 16), outline=FAINT)
        draw.text((cx + _SWATCH_W + 8, cy + 8), label, font=f_text, fill=INK, anchor="lm")
    y += 24 * -(-len(items) // 3) + 6
    draw.text((_MARGIN, y), summary, font=f_text, fill=INK)


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
