"""Heat-map pictures and JSON of one disk: what vmcache pinned, what the guest loaded and wrote, how hot.

One module per job:

- ``data``: :class:`HeatmapData`, the per-block state a map shows (numpy only:
  the engine builds it, importing the engine does not load Pillow);
- ``grid``: where blocks go (the layout) and each cell's colour (pure);
- ``render``: drawing with Pillow, PNG bytes out;
- ``codec``: the JSON form and back;
- ``writer``: the files an agent writes every few cycles;
- ``pages``: ``/heatmap/<disk>.png|json`` for the metrics server.

Names are loaded from their module on first use, so ``from
vmcache.observe.heatmap import HeatmapData`` does not import Pillow.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .codec import JSON_FORMAT, heatmap_from_json, heatmap_json
    from .data import HeatmapData, pinned_regions
    from .grid import Layout, RenderOptions, cell_colours, layout
    from .pages import heatmap_page
    from .render import block_pixel, offset_label, render_image, render_png
    from .writer import HeatmapWriter

_WHERE = {
    "HeatmapData": "data", "pinned_regions": "data",
    "RenderOptions": "grid", "Layout": "grid", "layout": "grid", "cell_colours": "grid",
    "render_image": "render", "render_png": "render", "block_pixel": "render", "offset_label": "render",
    "JSON_FORMAT": "codec", "heatmap_json": "codec", "heatmap_from_json": "codec",
    "HeatmapWriter": "writer",
    "heatmap_page": "pages",
}

__all__ = [
    "HeatmapData", "pinned_regions", "RenderOptions", "Layout", "layout", "cell_colours", "render_image",
    "render_png", "block_pixel", "offset_label", "JSON_FORMAT", "heatmap_json", "heatmap_from_json",
    "HeatmapWriter", "heatmap_page",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
