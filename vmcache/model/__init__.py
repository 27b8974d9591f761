"""Heat model and region planning: numpy/scipy only, no I/O, no clock."""

from __future__ import annotations

from .heat import HeatModel
from .params import PAGE_SIZE, ModelParams
from .planner import plan
from .region import Region

__all__ = ["HeatModel", "ModelParams", "PAGE_SIZE", "Region", "plan"]
