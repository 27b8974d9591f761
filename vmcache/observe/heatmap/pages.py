"""The agent's heat-map pages over HTTP: ``/heatmap/<disk>.png`` and ``.json``."""

from __future__ import annotations

import json
from collections.abc import Callable

from .codec import heatmap_json
from .data import HeatmapData
from .grid import RenderOptions

__all__ = ["heatmap_page"]


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
        from .render import render_png  # Pillow only when a picture is asked for

        return "image/png", render_png(data, options)
    return "application/json", json.dumps(heatmap_json(data)).encode() + b"\n"
