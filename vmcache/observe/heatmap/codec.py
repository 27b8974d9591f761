"""The heat map as JSON (``vmcache heatmap --json``, ``/heatmap/<disk>.json``) and back."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import numpy as np

from .data import HeatmapData, pinned_regions
from .grid import Layout, cell_values

__all__ = ["JSON_FORMAT", "heatmap_json", "heatmap_from_json"]

JSON_FORMAT = "vmcache-heatmap/1"


def heatmap_json(data: HeatmapData, *, max_buckets: int = 4096, digits: int = 4) -> dict[str, Any]:
    """Regions and per-bucket heat as a JSON-ready dict.

    A bucket is a whole number of blocks (as few as ``max_buckets`` allows):
    ``heat`` and ``written`` are the highest in the bucket, ``pinned`` and
    ``resident`` the mean fraction; ``read`` (where the kernel counts the
    guest's reads) the highest. ``regions`` are the exact pinned runs.
    """
    bucket_blocks = max(1, -(-data.nblocks // max_buckets))
    nb = -(-data.nblocks // bucket_blocks) if data.nblocks else 0
    lay = Layout(bucket_blocks, max(nb, 1), 1, 1, 0)
    names = ("heat", "pinned", "resident", "written") + (("read",) if data.read is not None else ())
    cells = cell_values(data, lay) if data.nblocks else {k: np.zeros((1, 0)) for k in names}

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
        "buckets": {name: values(name) for name in names},
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
        read=np.array(b["read"], dtype=np.float32) if "read" in b else None,
    )
