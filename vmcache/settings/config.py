"""The host configuration, /etc/vmcache/vmcache.yaml, as a validated HostConfig (pure).

Every key has a default that works, so a missing file means "all defaults".
Anything wrong - invalid YAML, an unknown or duplicated key, a bad value -
raises :class:`~vmcache.errors.ConfigError`, whose ``str()`` is one line
naming the key (dotted for nested keys: ``metrics.listen``; a host rule by
its place and line: ``domains[2] (line 14) match.flavor``) and the value.
docs/configuration.md describes every key; hooks/vmcache.yaml is the
commented default file ``make install`` puts in place.

Pure: text in, HostConfig out (and its JSON form, for the cache of
validated configs vmcache.host.configfile keeps); reading the file is
vmcache.host.configfile's. No libvirt, numpy or socket code: the libvirt
hook loads this module on every domain start, with ``check_model=False``
(vmcache.model's package imports numpy; the hook needs no model, and the
agent it starts checks the ``model`` section and reports it). PyYAML is
imported only when a text is parsed (vmcache.settings.yamltext); the
``domains:`` rules are vmcache.settings.rules', loaded only when a config has some.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from ..units import parse_duration, parse_size
from .metrics import MetricsConfig, metrics_from_json, parse_metrics
from .yamltext import abs_path, key_text, load_yaml, no_unknown, whole
from .yamltext import section as mapping_section

if TYPE_CHECKING:
    from ..model.params import ModelParams
    from .rules import Rule

__all__ = [
    "DEFAULT_PATH",
    "CACHE_MODES",
    "NEVER_ELIGIBLE",
    "HostConfig",
    "PinnedCap",
    "HeatmapConfig",
    "parse_host_config",
    "config_to_json",
    "config_from_json",
]

DEFAULT_PATH = "/etc/vmcache/vmcache.yaml"

#: Cache modes whose image QEMU opens without O_DIRECT (through the page cache).
CACHE_MODES = ("writethrough", "writeback", "unsafe")
#: Cache modes that bypass the page cache: vmcache has nothing to keep there.
NEVER_ELIGIBLE = ("none", "directsync")


@dataclass(frozen=True)
class PinnedCap:
    """Host-wide cap on bytes pinned by all agents together: a size or a share of RAM."""

    size: int | None = None
    fraction: float | None = 0.5

    def bytes_for(self, mem_total: int) -> int:
        """The cap in bytes on a host with ``mem_total`` bytes of RAM."""
        if self.size is not None:
            return self.size
        assert self.fraction is not None
        return int(mem_total * self.fraction)

    def __str__(self) -> str:
        if self.size is not None:
            return str(self.size)
        return f"{(self.fraction or 0) * 100:g}%"


@dataclass(frozen=True)
class HeatmapConfig:
    """Heat-map pictures: where they go and how they are drawn."""

    dir: str = "/var/lib/vmcache/heatmaps"
    every: int = 0                      # cycles between pictures; 0: only on request
    blocks_per_pixel: int | None = None  # None: fit the disk into the picture
    aspect: float = 2.0                 # width / height of the picture


@dataclass(frozen=True)
class HostConfig:
    """Host-wide settings and the defaults of every per-domain parameter.

    Sizes are bytes, durations seconds. ``model`` holds the operator's model
    parameters as given (already validated); :meth:`model_params` builds the
    ModelParams a domain uses.
    """

    budget: int = 1 << 30
    min_free: int = 1 << 30
    prefetch_rate: int | None = 8 << 20
    warm_rate: int = 32 << 20           # the prefetch rate while a saved hot set is restored (the higher applies)
    fill: str = "whole"                 # "cached": pins lock only cached pages and read nothing (FILLS)
    psi_threshold: float = 10.0
    interval: float = 10.0
    hotset_interval: float = 300.0      # seconds between saves of the hot set; 0: never saved
    hotset_dir: str | None = "/var/lib/vmcache/hotsets"  # the host's copies of hot sets; None: kept in the XML only
    hotset_keep: int = 1000             # most host copies kept (the oldest go first)
    hotset_max_age: float = 30 * 86400.0  # a host copy not saved again for this long is removed
    cache_modes: frozenset[str] = frozenset({"writethrough"})
    pinned_cap: PinnedCap = PinnedCap()
    model: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    runtime_dir: str = "/run/vmcache"
    log_dir: str = "/var/log/vmcache"
    agent_command: tuple[str, ...] | None = None
    metrics: MetricsConfig = MetricsConfig()
    heatmap: HeatmapConfig = HeatmapConfig()
    rules: tuple[Rule, ...] = ()        # the domains: list, in order (vmcache.settings.rules)
    read_model: str = "counted"         # what the model decides on: the counted reads, or inferred ones

    def model_params(self, overrides: Mapping[str, Any] | None = None) -> ModelParams:
        """ModelParams from the host's ``model`` section, ``interval`` and a domain's overrides.

        Raises ConfigError naming the key when an override is not acceptable.
        """
        from ..model.params import ModelParams  # numpy comes with the package: not at import time
        merged: dict[str, Any] = {"interval": self.interval, **self.model}
        params = ModelParams.from_mapping(merged, prefix="model.")
        if overrides:
            merged.update(overrides)
            params = ModelParams.from_mapping(merged, prefix="metadata model.")
        return params

    @property
    def agents_dir(self) -> str:
        """Where agents keep their pidfiles and status files."""
        return os.path.join(self.runtime_dir, "agents")

    @property
    def targets_dir(self) -> str:
        """Where agents keep their Prometheus file_sd targets files."""
        return os.path.join(self.runtime_dir, "prometheus")

    @property
    def ledger_path(self) -> str:
        """The shared ledger of pinned bytes (see vmcache.host.ledger)."""
        return os.path.join(self.runtime_dir, "ledger.json")

    @property
    def warmup_path(self) -> str:
        """The host's warm-up budget shared by the agents (see vmcache.host.warmpool)."""
        return os.path.join(self.runtime_dir, "warmup.json")


# --- the JSON form of a validated config (what vmcache.host.configfile caches) ---


def config_to_json(value: Any) -> Any:
    """HostConfig and its parts as JSON values (dataclasses as objects, sets sorted)."""
    if is_dataclass(value):
        return {f.name: config_to_json(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, (frozenset, set)):
        return sorted(value)
    if isinstance(value, Mapping):
        return {k: config_to_json(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [config_to_json(v) for v in value]
    return value


def config_from_json(data: dict[str, Any]) -> HostConfig:
    """The inverse of :func:`config_to_json` for a HostConfig (KeyError/TypeError if it does not fit)."""
    command = data["agent_command"]
    return HostConfig(**{
        **data,
        "cache_modes": frozenset(data["cache_modes"]),
        "pinned_cap": PinnedCap(**data["pinned_cap"]),
        "model": MappingProxyType(dict(data["model"])),
        "agent_command": None if command is None else tuple(command),
        "metrics": metrics_from_json(data["metrics"]),
        "heatmap": HeatmapConfig(**data["heatmap"]),
        "rules": _rules_from_json(data["rules"]),
    })


def _rules_from_json(data: list[dict[str, Any]]) -> tuple[Rule, ...]:
    if not data:
        return ()  # the hook's common path: no rules, no rules module
    from .rules import rules_from_json

    return rules_from_json(data)


def parse_host_config(text: str, *, source: str = DEFAULT_PATH, check_model: bool = True) -> HostConfig:
    """Parse the YAML text of a host config; ConfigError naming key and value (and line) if it is wrong."""
    data = load_yaml(text, source)
    if data is None:
        return HostConfig()
    if not isinstance(data, dict):
        raise ConfigError(source, data, "must be a mapping of keys to values")
    return _host_config(data, check_model)


def _host_config(data: dict[Any, Any], check_model: bool) -> HostConfig:
    no_unknown(data, _TOP_KEYS, "")
    values: dict[str, Any] = {}
    if "budget" in data:
        values["budget"] = parse_size(data["budget"], key="budget")
    if "min_free" in data:
        values["min_free"] = parse_size(data["min_free"], key="min_free")
    if "prefetch_rate" in data:
        values["prefetch_rate"] = (None if data["prefetch_rate"] in ("unlimited", None)
                                   else parse_size(data["prefetch_rate"], key="prefetch_rate"))
    if "warm_rate" in data:
        values["warm_rate"] = _warm_rate(data["warm_rate"])
    if "fill" in data:
        values["fill"] = _choice(data["fill"], "fill", FILLS)
    if "psi_threshold" in data:
        values["psi_threshold"] = _percent(data["psi_threshold"], "psi_threshold")
    if "interval" in data:
        values["interval"] = parse_duration(data["interval"], key="interval", minimum=0.1)
        if values["interval"] > 86400:
            raise ConfigError("interval", data["interval"], "must be at most 1 day")
    if "hotset_interval" in data:
        values["hotset_interval"] = (0.0 if data["hotset_interval"] in (0, "0", "never")
                                     else parse_duration(data["hotset_interval"], key="hotset_interval", minimum=1.0))
    if "hotset_dir" in data:
        values["hotset_dir"] = None if data["hotset_dir"] is None else abs_path(data["hotset_dir"], "hotset_dir")
    if "hotset_keep" in data:
        values["hotset_keep"] = whole(data["hotset_keep"], "hotset_keep", 1)
    if "hotset_max_age" in data:
        values["hotset_max_age"] = parse_duration(data["hotset_max_age"], key="hotset_max_age", minimum=3600.0)
    if "cache_modes" in data:
        values["cache_modes"] = _cache_modes(data["cache_modes"])
    if "pinned_cap" in data:
        values["pinned_cap"] = _pinned_cap(data["pinned_cap"])
    if "model" in data:
        values["model"] = _model(data["model"])
    for key in ("runtime_dir", "log_dir"):
        if key in data:
            values[key] = abs_path(data[key], key)
    if "agent_command" in data:
        values["agent_command"] = _command(data["agent_command"])
    if "metrics" in data:
        values["metrics"] = parse_metrics(data["metrics"])
    if "heatmap" in data:
        values["heatmap"] = _heatmap(data["heatmap"])
    if "read_model" in data:
        values["read_model"] = _choice(data["read_model"], "read_model", READ_MODELS)
    if "domains" in data:
        from .rules import parse_rules  # here: a host without rules (most) never loads them

        values["rules"] = parse_rules(data["domains"])
    config = HostConfig(**values)
    if check_model:
        config.model_params()  # every value and cross-field checks (e.g. pinned_decay >= decay)
    return config


_TOP_KEYS = ("budget", "min_free", "prefetch_rate", "warm_rate", "fill", "psi_threshold", "interval", "hotset_interval",
             "hotset_dir", "hotset_keep", "hotset_max_age", "cache_modes", "pinned_cap", "model",
             "runtime_dir", "log_dir", "agent_command", "metrics", "heatmap", "domains", "read_model")
_HEATMAP_KEYS = ("dir", "every", "blocks_per_pixel", "aspect")


READ_MODELS = ("inferred", "counted")
FILLS = ("whole", "cached")
"""``fill``: whether a new pin reads the pages of its blocks that are not cached (``whole``, at
``prefetch_rate``) or locks only the pages cached, its own and those the guest reads later
(``cached``: vmcache reads nothing from the device but to restore a saved hot set)."""


def _choice(value: object, key: str, choices: tuple[str, ...]) -> str:
    """``key``: one of ``choices`` (``read_model``: READ_MODELS, ``fill``: FILLS)."""
    if value not in choices:
        named = f"{', '.join(choices[:-1])} or {choices[-1]}"
        raise ConfigError(key, value, f"must be {named} (docs/configuration.md)")
    return str(value)


def _warm_rate(value: object) -> int:
    """``warm_rate``: a size above 0 (bytes per second)."""
    if value in ("unlimited", None):
        raise ConfigError("warm_rate", value, "must be a rate such as 32M (bytes per second); a warm start is "
                          "never unlimited: give a large rate to restore the saved set in one cycle")
    rate = parse_size(value, key="warm_rate")
    if rate <= 0:
        raise ConfigError("warm_rate", value, "must be more than 0 (a saved hot set is restored at the higher of "
                          "prefetch_rate and warm_rate)")
    return rate


def _cache_modes(value: object) -> frozenset[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ConfigError("cache_modes", value, "must be a list of cache modes, e.g. [writethrough]")
    modes = set()
    for mode in value:
        if mode in NEVER_ELIGIBLE:
            raise ConfigError("cache_modes", mode, "bypasses the page cache (O_DIRECT), never eligible")
        if mode not in CACHE_MODES:
            raise ConfigError("cache_modes", mode, "unknown cache mode (use " + ", ".join(CACHE_MODES) + ")")
        modes.add(mode)
    return frozenset(modes)


_PARAM_RE = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
_PERCENT_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*%\s*$")


def _percent(value: object, key: str) -> float:
    """A percentage in (0, 100]: a number or a number with ``%`` (``10``, ``12.5%``)."""
    text = value[:-1].strip() if isinstance(value, str) and value.strip().endswith("%") else value
    try:
        if isinstance(text, bool):
            raise ValueError
        number = float(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigError(key, value, "must be a percentage, e.g. 10 or 12.5%") from None
    if not 0 < number <= 100:
        raise ConfigError(key, value, "must be in (0, 100]")
    return number


def _pinned_cap(value: object) -> PinnedCap:
    if isinstance(value, str) and (match := _PERCENT_RE.match(value)):
        percent = float(match.group(1))
        if not 0 < percent <= 100:
            raise ConfigError("pinned_cap", value, "a share of RAM must be in (0%, 100%]")
        return PinnedCap(size=None, fraction=percent / 100)
    return PinnedCap(size=parse_size(value, key="pinned_cap"), fraction=None)


def _model(value: object) -> Mapping[str, Any]:
    section = mapping_section(value, "model")
    if "interval" in section:
        raise ConfigError("model.interval", section["interval"], "set the top-level interval key instead")
    for key, value in section.items():
        if not isinstance(key, str) or not _PARAM_RE.match(key):
            raise ConfigError(f"model.{key_text(key)}", value, "unknown model parameter")
    return MappingProxyType(dict(section))


def _command(value: object) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = value.split()
    if (not isinstance(value, list) or not value
            or not all(isinstance(a, str) and a and "\0" not in a for a in value)):
        raise ConfigError("agent_command", value, "must be a command as a list of strings, or null")
    if not value[0].startswith("/"):
        raise ConfigError("agent_command", value, "the program must be an absolute path")
    return tuple(value)


def _heatmap(value: object) -> HeatmapConfig:
    section = mapping_section(value, "heatmap")
    no_unknown(section, _HEATMAP_KEYS, "heatmap.")
    values: dict[str, Any] = {}
    if "dir" in section:
        values["dir"] = abs_path(section["dir"], "heatmap.dir")
    if "every" in section:
        values["every"] = whole(section["every"], "heatmap.every", 0)
    if "blocks_per_pixel" in section and section["blocks_per_pixel"] not in (None, "auto"):
        values["blocks_per_pixel"] = whole(section["blocks_per_pixel"], "heatmap.blocks_per_pixel", 1)
    if "aspect" in section:
        aspect = section["aspect"]
        if isinstance(aspect, bool) or not isinstance(aspect, (int, float)) or not 0.01 <= aspect <= 100:
            raise ConfigError("heatmap.aspect", aspect, "must be a number in [0.01, 100] (width / height)")
        values["aspect"] = float(aspect)
    return HeatmapConfig(**values)
