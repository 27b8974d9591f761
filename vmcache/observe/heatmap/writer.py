"""Heat-map files an agent writes every few cycles (PNG and/or JSON, atomically)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

from ...host.files import write_atomic
from .codec import heatmap_json
from .data import HeatmapData
from .grid import RenderOptions

__all__ = ["HeatmapWriter"]


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
            from .render import render_png  # Pillow only once a picture is due, not when an agent starts

            write_atomic(self.png_path, render_png(data, self.options), what="heat map")
        if self.json_path is not None:
            write_atomic(self.json_path, json.dumps(heatmap_json(data)).encode() + b"\n", what="heat map")
        return True
