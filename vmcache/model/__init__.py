"""Heat model and region planning: numpy only, no I/O, no clock.

``ModelParams`` and ``Region`` are plain Python; ``HeatModel`` and ``plan``
load numpy on first use, so that commands and the libvirt hook which only
validate parameters start quickly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .params import PAGE_SIZE, ModelParams
from .region import Region

if TYPE_CHECKING:
    from .heat import HeatModel
    from .planner import plan

__all__ = ["HeatModel", "ModelParams", "PAGE_SIZE", "Region", "plan"]


def __getattr__(name: str) -> Any:
    if name == "HeatModel":
        from .heat import HeatModel

        return HeatModel
    if name == "plan":
        from .planner import plan

        return plan
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
