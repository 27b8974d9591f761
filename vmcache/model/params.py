"""ModelParams: the parameters of the heat model and region planner (pure).

These are the parameters of the vmdisktouch paper's tool that belong to the
model (Gaussian amplitudes and widths, decay, threshold, cycle length) plus
the ones vmcache needs to stay safe on a host (block size, region count cap,
merging, hysteresis). Parameters that belong elsewhere are not here: the byte
budget is an argument of :func:`vmcache.model.planner.plan` (it is a property
of the host/domain, not of the model), the free-memory floor belongs to the
pinner, and heat-map picture options to whatever draws the picture.

Every instance is valid: the constructor runs :meth:`ModelParams.validate`.
Operator input goes through :meth:`ModelParams.from_mapping`, which maps
snake_case keys 1:1 onto the fields and raises :class:`ConfigError` (one
line, naming the key and the value) for an unknown key, a wrong type or an
out-of-range value.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from ..errors import ConfigError
from ..units import parse_duration, parse_size

__all__ = ["ModelParams", "PAGE_SIZE"]

PAGE_SIZE = 4096
"""Page size the model aligns to (x86-64 host page)."""

MAX_BLOCK_SIZE = 1 << 30
MAX_SIGMA = 16.0
"""Widest Gaussian (blocks): the filter costs O(nblocks * 4 * sigma) per step
(measured ~31 ms per pass at sigma 16, ~5.5 ms at 2, for 1M blocks)."""
MAX_REGIONS = 16384
"""Hard cap on max_regions: each pinned region can cost up to two VMAs
(vm.max_map_count is 65530 by default, shared by the whole agent)."""


@dataclass(frozen=True)
class ModelParams:
    """Parameters of the heat model and planner, all with working defaults.

    Fields (units in brackets):

    - ``block_size`` [bytes]: model granularity; a multiple of 4096, at most
      1 GiB. Default 1 MiB (a 1 TiB image is 1M blocks).
    - ``read_amplitude`` [heat] ``a_r``: weight of guest residency. A wide,
      fully resident region (not caused by vmcache) heats towards this value.
      Default 1.0.
    - ``read_sigma`` [blocks] ``sigma_r``: width of the Gaussian smoothing of
      residency; 0 disables smoothing. Isolated resident blocks are diluted,
      runs of resident blocks keep their height. At most 16 (cost grows
      with the width). Default 2.0.
    - ``write_amplitude`` [heat] ``a_w``: weight of the fraction of a block
      written in one cycle. Higher than ``read_amplitude`` so that written
      regions outrank read-only ones of equal residency. Default 4.0.
    - ``write_sigma`` [blocks] ``sigma_w``: Gaussian width for writes; 0
      disables smoothing; at most 16. Default 2.0.
    - ``decay`` [per interval] ``d``: fraction of heat kept after one
      reference interval; 0 < decay < 1. A step after ``dt`` seconds uses
      ``decay ** (dt / interval)``. Default 0.9 (heat half-life ~6.6
      intervals).
    - ``pinned_decay`` [per interval]: decay for blocks in ``ours`` (pinned,
      or loaded by vmcache and still resident). Guest reads of such blocks are
      page-cache hits that leave no trace, so their heat is held: it fades at
      this slower rate unless fresh evidence (writes, neighbours) raises it.
      This sets how long a region with no visible activity stays pinned.
      ``decay <= pinned_decay < 1``; equal to ``decay`` gives the paper's
      plain model. Default 0.98 (half-life ~34 intervals).
    - ``interval`` [seconds]: reference cycle length the decay is given for
      (also the engine's intended cycle length). Default 10.0.
    - ``threshold`` [heat]: blocks hotter than this form regions. Default 0.2.
    - ``keep_factor`` [ratio >= 1]: hysteresis for regions pinned now. The
      planner multiplies their heat by this factor, so a pinned region is
      released only once its heat falls below ``threshold / keep_factor``,
      and a new region must be this much hotter to displace it from the
      budget. 1.0 disables hysteresis. Default 2.0.
    - ``max_regions`` [count]: most regions a plan returns, so that mlock'd
      VMAs stay far below vm.max_map_count (65530); 1..16384. Default 1024.
    - ``merge_gap`` [blocks]: hot runs separated by at most this many cold
      blocks are merged into one region (the gap is pinned too). 0 merges
      nothing. Default 4.
    - ``min_region`` [blocks]: hot runs (after merging) shorter than this are
      ignored. Default 1.
    - ``seen_scale`` [ratio > 0]: weight of the read evidence of pinned
      blocks (the fraction of a block's sampled pages the guest read since
      the previous cycle, from the pages' referenced bits): evidence ``e``
      counts as residency ``min(1, seen_scale * e)``, so by default a block
      of which a quarter of the pages were read in one interval is fully
      hot. Default 4.0.
    - ``miss_contrast`` [ratio, 0 or >= 1]: how the read misses of one cycle
      count, relative to the guest's own read rate. A block's read misses
      (residency that appeared in it since the previous cycle, not by
      vmcache's hand nor by writes) are compared with its fair share of all
      the cycle's reads (its read misses plus the read evidence of pinned
      blocks, spread evenly over the disk's blocks); a block taking
      ``miss_contrast`` times its fair share counts as fully resident for
      that cycle: its residency input is ``max(R, min(1, misses /
      (miss_contrast * fair share)))``. So a slow guest,
      whose hot blocks fill a few pages per cycle, shows its hot set as
      clearly as a fast one (a hot zone of 10% of the disk taking 90% of the
      reads inputs ``9 / miss_contrast``), while reads spread evenly over
      the disk input ``1 / miss_contrast`` on average, under the threshold,
      and a one-pass read counts in one cycle only (one cycle of full input
      heats a block to ``1 - decay``, under the threshold). Where the
      pinned blocks' read evidence is too weak to hold any of them (mean
      ``seen_scale * e`` under ``threshold / keep_factor``), each pinned
      block's evidence is judged the same way, up to ``threshold *
      keep_factor``: a slow guest's pins stay while it reads them. 0
      disables both (residency level only, evidence absolute). Default
      12.0.
    """

    block_size: int = 1 << 20
    read_amplitude: float = 1.0
    read_sigma: float = 2.0
    write_amplitude: float = 4.0
    write_sigma: float = 2.0
    decay: float = 0.9
    pinned_decay: float = 0.98
    interval: float = 10.0
    threshold: float = 0.2
    keep_factor: float = 2.0
    max_regions: int = 1024
    merge_gap: int = 4
    min_region: int = 1
    seen_scale: float = 4.0
    miss_contrast: float = 12.0

    def __post_init__(self) -> None:
        self.validate()
        for f in fields(self):  # 1 -> 1.0 for float fields given as int
            if _RANGES[f.name][0] is float:
                object.__setattr__(self, f.name, float(getattr(self, f.name)))

    def validate(self, *, prefix: str = "") -> None:
        """Check every field; raise ConfigError naming ``prefix + field`` and its value."""
        for f in fields(self):
            _check(f.name, getattr(self, f.name), prefix + f.name)
        if self.read_amplitude == 0 and self.write_amplitude == 0:
            raise ConfigError(prefix + "write_amplitude", self.write_amplitude,
                              "read_amplitude and write_amplitude cannot both be 0")
        if 0 < self.miss_contrast < 1:
            raise ConfigError(prefix + "miss_contrast", self.miss_contrast, "must be 0 (off) or at least 1")
        if self.pinned_decay < self.decay:
            raise ConfigError(prefix + "pinned_decay", self.pinned_decay,
                              f"must be at least decay ({self.decay:g})")

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any], prefix: str = "") -> ModelParams:
        """Build from operator input (e.g. a YAML section); missing keys keep defaults.

        ``block_size`` accepts sizes such as ``"1M"``/``"64KiB"``; ``interval``
        accepts durations such as ``"10s"``/``"500ms"``. ``prefix`` (e.g.
        ``"model."``) is put before the key in error messages. Raises
        ConfigError for an unknown key, a wrong type or an out-of-range value.
        """
        if not isinstance(mapping, Mapping):
            raise ConfigError(prefix.rstrip(".") or "model", mapping, "must be a mapping of parameters")
        known = {f.name for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, raw in mapping.items():
            name = prefix + str(key)
            if key not in known:
                raise ConfigError(name, raw, "unknown model parameter (known: " + ", ".join(sorted(known)) + ")")
            try:
                if key == "block_size":
                    value: Any = parse_size(raw, key=name, allow_zero=False)
                elif key == "interval":
                    value = parse_duration(raw, key=name)
                else:
                    value = raw
                _check(key, value, name)
            except ConfigError as err:  # show the operator's value, not the parsed one
                raise ConfigError(name, raw, err.reason) from None
            values[key] = value
        try:
            return cls(**values)
        except ConfigError as err:  # cross-field checks: add the prefix
            raise ConfigError(prefix + err.key, err.value, err.reason) from None


# field -> (kind, low, high, low_open, high_open)
_RANGES: dict[str, tuple[type, float, float, bool, bool]] = {
    "block_size": (int, PAGE_SIZE, MAX_BLOCK_SIZE, False, False),
    "read_amplitude": (float, 0.0, 1e6, False, False),
    "read_sigma": (float, 0.0, MAX_SIGMA, False, False),
    "write_amplitude": (float, 0.0, 1e6, False, False),
    "write_sigma": (float, 0.0, MAX_SIGMA, False, False),
    "decay": (float, 0.0, 1.0, True, True),
    "pinned_decay": (float, 0.0, 1.0, True, True),
    "interval": (float, 0.0, 86400.0, True, False),
    "threshold": (float, 0.0, 1e6, True, False),
    "keep_factor": (float, 1.0, 1e3, False, False),
    "max_regions": (int, 1, MAX_REGIONS, False, False),
    "merge_gap": (int, 0, 1 << 30, False, False),
    "min_region": (int, 1, 1 << 30, False, False),
    "seen_scale": (float, 0.0, 1e6, True, False),
    "miss_contrast": (float, 0.0, 1e6, False, False),
}


def _check(field: str, value: object, key: str) -> None:
    """Raise ConfigError(key, value, ...) unless ``value`` fits ``field``."""
    kind, low, high, low_open, high_open = _RANGES[field]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(key, value, "must be " + ("a whole number" if kind is int else "a number"))
    if kind is int and not isinstance(value, int):
        raise ConfigError(key, value, "must be a whole number")
    if not math.isfinite(value):
        raise ConfigError(key, value, "must be a finite number")
    too_low = value <= low if low_open else value < low
    too_high = value >= high if high_open else value > high
    if too_low or too_high:
        lo = "(" if low_open else "["
        hi = ")" if high_open else "]"
        raise ConfigError(key, value, f"must be in {lo}{_num(low)}, {_num(high)}{hi}")
    if field == "block_size" and value % PAGE_SIZE:
        raise ConfigError(key, value, f"must be a multiple of {PAGE_SIZE}")


def _num(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"
