"""The host configuration, /etc/vmcache/vmcache.yaml, as a validated HostConfig (pure).

Every key has a default that works, so a missing file means "all defaults".
Anything wrong - invalid YAML, an unknown or duplicated key, a bad value -
raises :class:`~vmcache.errors.ConfigError`, whose ``str()`` is one line
naming the key (dotted for nested keys: ``metrics.listen``) and the value.
docs/configuration.md describes every key; hooks/vmcache.yaml is the
commented default file ``make install`` puts in place.

This module reads one file and imports no libvirt, numpy or socket code:
the libvirt hook loads it on every domain start, with ``check_model=False``
(vmcache.model's package imports numpy; the hook needs no model, and the
agent it starts checks the ``model`` section and reports it). PyYAML is
imported only when a file is parsed: with ``cache_dir`` (the hook passes
:data:`CACHE_DIR`), the validated config is kept as JSON keyed by the
file's identity, and read back instead while the file is unchanged.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from ..units import parse_duration, parse_size

if TYPE_CHECKING:
    from ..model.params import ModelParams

__all__ = [
    "DEFAULT_PATH",
    "CACHE_MODES",
    "NEVER_ELIGIBLE",
    "HostConfig",
    "PinnedCap",
    "MetricsConfig",
    "MetricsTLS",
    "MetricsBasicAuth",
    "HeatmapConfig",
    "load_host_config",
    "parse_host_config",
    "CACHE_DIR",
    "cache_path",
]

DEFAULT_PATH = "/etc/vmcache/vmcache.yaml"
#: Where load_host_config(cache_dir=CACHE_DIR) keeps validated configs (beside the
#: default runtime_dir: it is read before the config, and so its runtime_dir, is known).
CACHE_DIR = "/run/vmcache/config-cache"

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
class MetricsTLS:
    """HTTPS for the metrics endpoint (fields as vmcache.observe.exporter.TLSOptions takes them)."""

    certfile: str
    keyfile: str
    client_cafile: str | None = None
    client_auth_required: bool = False


@dataclass(frozen=True)
class MetricsBasicAuth:
    """HTTP basic auth: user name and a file holding the password (as vmcache.observe.exporter.BasicAuth)."""

    username: str
    password_file: str


@dataclass(frozen=True)
class MetricsConfig:
    """Where agents serve Prometheus metrics: each agent takes the first free port of the range."""

    listen: str = "127.0.0.1"
    port_first: int = 9850
    port_last: int = 9999
    tls: MetricsTLS | None = None
    basic_auth: MetricsBasicAuth | None = None

    @property
    def ports(self) -> range:
        return range(self.port_first, self.port_last + 1)


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
    psi_threshold: float = 10.0
    interval: float = 10.0
    hotset_interval: float = 300.0      # seconds between saves of the hot set; 0: never saved
    cache_modes: frozenset[str] = frozenset({"writethrough"})
    pinned_cap: PinnedCap = PinnedCap()
    model: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    runtime_dir: str = "/run/vmcache"
    log_dir: str = "/var/log/vmcache"
    agent_command: tuple[str, ...] | None = None
    metrics: MetricsConfig = MetricsConfig()
    heatmap: HeatmapConfig = HeatmapConfig()

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
    def ledger_path(self) -> str:
        """The shared ledger of pinned bytes (see vmcache.host.ledger)."""
        return os.path.join(self.runtime_dir, "ledger.json")


# --- loading ----------------------------------------------------------------

_strict_loader: type | None = None


def _loader() -> type:
    """SafeLoader that refuses duplicated keys instead of keeping the last one (PyYAML imported here)."""
    global _strict_loader
    if _strict_loader is None:
        import yaml

        class StrictLoader(yaml.SafeLoader):
            pass

        StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
        _strict_loader = StrictLoader
    return _strict_loader


def _construct_mapping(loader: Any, node: Any, deep: bool = False) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            duplicate = key in seen
        except TypeError:  # an unhashable key: let PyYAML report it
            break
        if duplicate:
            mark = key_node.start_mark
            raise ConfigError(_key_text(key), None, f"key given twice (line {mark.line + 1})")
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


def load_host_config(path: str = DEFAULT_PATH, *, check_model: bool = True,
                     cache_dir: str | None = None) -> HostConfig:
    """Read the host config at ``path``; a missing file gives the defaults.

    Raises ConfigError for unreadable files, invalid YAML and bad values.
    ``check_model=False`` leaves the ``model`` section's values unchecked
    (for the hook, which must not import numpy). With ``cache_dir``, a
    valid config is cached there (:func:`cache_path`) and read back, without
    PyYAML, while the file keeps its identity (device, inode, size, mtime,
    ctime); a stale, foreign or damaged cache file is ignored.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return HostConfig()
    except OSError as err:
        raise ConfigError(path, None, f"cannot read: {err}") from err
    try:
        st = os.fstat(fd)
        key = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
        cached = _read_cache(cache_path(path, cache_dir), path, key) if cache_dir is not None else None
        if cached is not None:
            if check_model:
                cached.model_params()
            return cached
        try:
            with open(fd, encoding="utf-8", closefd=False) as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(path, None, f"cannot read: {err}") from err
    finally:
        os.close(fd)
    config = parse_host_config(text, source=path, check_model=check_model)
    if cache_dir is not None and _settled(st):
        _write_cache(cache_path(path, cache_dir), path, key, config)
    return config


# --- the cache of validated configs (for the hook) ---------------------------

_CACHE_VERSION = 1
_SETTLE_NS = 2_000_000_000
_MAX_NAME = 200


def cache_path(path: str, cache_dir: str = CACHE_DIR) -> str:
    """The cache file of the config at ``path``: its absolute path as a file name (``/`` as ``%2F``)."""
    name = os.path.abspath(path).replace("%", "%25").replace("/", "%2F")
    if len(name) > _MAX_NAME:
        import hashlib

        digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:16]
        name = f"{name[-(_MAX_NAME - 17):]}~{digest}"
    return os.path.join(cache_dir, name + ".json")


def _settled(st: os.stat_result) -> bool:
    """False while the file changed within the last 2 s: a write in the same clock tick could
    keep size and mtime (git's "racily clean" case), so such a file is not cached yet."""
    import time

    return time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) > _SETTLE_NS


def _read_cache(cache: str, path: str, key: list[int]) -> HostConfig | None:
    """The cached config if ``cache`` is a regular file owned by root (or us), writable by its
    owner only, and recorded for ``path`` with this ``key``; else None (parse the file)."""
    try:
        fd = os.open(cache, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if (not stat.S_ISREG(st.st_mode) or st.st_uid not in (0, os.geteuid())
                or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)):
            return None
        with open(fd, "rb", closefd=False) as f:
            raw = f.read(1 << 20)
    except OSError:
        return None
    finally:
        os.close(fd)
    import json

    try:
        data = json.loads(raw)
        if data["version"] != _CACHE_VERSION or data["path"] != os.path.abspath(path) or data["key"] != key:
            return None
        return _from_json(data["config"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _write_cache(cache: str, path: str, key: list[int], config: HostConfig) -> None:
    """Replace ``cache`` atomically with ``config`` if it survives the JSON round trip; never raises."""
    import json

    try:
        encoded = _to_json(config)
        if _from_json(json.loads(json.dumps(encoded))) != config:
            return  # e.g. model values JSON cannot carry exactly
        text = json.dumps({"version": _CACHE_VERSION, "path": os.path.abspath(path), "key": key,
                           "config": encoded}, sort_keys=True)
    except (ValueError, TypeError, KeyError):
        return
    directory = os.path.dirname(cache)
    tmp = os.path.join(directory, f".{os.path.basename(cache)}.{os.getpid()}.tmp")
    try:
        os.makedirs(directory, mode=0o755, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            os.fchmod(fd, 0o644)  # whatever the umask
            os.write(fd, text.encode())
        finally:
            os.close(fd)
        os.replace(tmp, cache)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def _to_json(value: Any) -> Any:
    """HostConfig and its parts as JSON values (dataclasses as objects, sets sorted)."""
    if is_dataclass(value):
        return {f.name: _to_json(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, (frozenset, set)):
        return sorted(value)
    if isinstance(value, Mapping):
        return {k: _to_json(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_to_json(v) for v in value]
    return value


def _from_json(data: dict[str, Any]) -> HostConfig:
    """The inverse of :func:`_to_json` for a HostConfig (KeyError/TypeError if it does not fit)."""
    metrics = dict(data["metrics"])
    if metrics["tls"] is not None:
        metrics["tls"] = MetricsTLS(**metrics["tls"])
    if metrics["basic_auth"] is not None:
        metrics["basic_auth"] = MetricsBasicAuth(**metrics["basic_auth"])
    command = data["agent_command"]
    return HostConfig(**{
        **data,
        "cache_modes": frozenset(data["cache_modes"]),
        "pinned_cap": PinnedCap(**data["pinned_cap"]),
        "model": MappingProxyType(dict(data["model"])),
        "agent_command": None if command is None else tuple(command),
        "metrics": MetricsConfig(**metrics),
        "heatmap": HeatmapConfig(**data["heatmap"]),
    })


def parse_host_config(text: str, *, source: str = DEFAULT_PATH, check_model: bool = True) -> HostConfig:
    """Parse the YAML text of a host config; ConfigError naming key and value if it is wrong."""
    import yaml  # here, not at import time: the hook mostly reads the cache (load_host_config)

    try:
        data = yaml.load(text, Loader=_loader())  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        line = text.splitlines()[mark.line] if mark is not None and mark.line < len(text.splitlines()) else ""
        raise ConfigError(where, line.strip(), f"invalid YAML: {err.problem}") from None
    except yaml.YAMLError as err:  # e.g. a character YAML does not allow
        raise ConfigError(source, None, "invalid YAML: " + " ".join(str(err).split())) from None
    except RecursionError:
        raise ConfigError(source, None, "invalid YAML: nested too deeply") from None
    if data is None:
        return HostConfig()
    if not isinstance(data, dict):
        raise ConfigError(source, data, "must be a mapping of keys to values")
    return _host_config(data, check_model)


def _host_config(data: dict[Any, Any], check_model: bool) -> HostConfig:
    _no_unknown(data, _TOP_KEYS, "")
    values: dict[str, Any] = {}
    if "budget" in data:
        values["budget"] = parse_size(data["budget"], key="budget")
    if "min_free" in data:
        values["min_free"] = parse_size(data["min_free"], key="min_free")
    if "prefetch_rate" in data:
        values["prefetch_rate"] = (None if data["prefetch_rate"] in ("unlimited", None)
                                   else parse_size(data["prefetch_rate"], key="prefetch_rate"))
    if "psi_threshold" in data:
        values["psi_threshold"] = _percent(data["psi_threshold"], "psi_threshold")
    if "interval" in data:
        values["interval"] = parse_duration(data["interval"], key="interval", minimum=0.1)
        if values["interval"] > 86400:
            raise ConfigError("interval", data["interval"], "must be at most 1 day")
    if "hotset_interval" in data:
        values["hotset_interval"] = (0.0 if data["hotset_interval"] in (0, "0", "never")
                                     else parse_duration(data["hotset_interval"], key="hotset_interval", minimum=1.0))
    if "cache_modes" in data:
        values["cache_modes"] = _cache_modes(data["cache_modes"])
    if "pinned_cap" in data:
        values["pinned_cap"] = _pinned_cap(data["pinned_cap"])
    if "model" in data:
        values["model"] = _model(data["model"])
    for key in ("runtime_dir", "log_dir"):
        if key in data:
            values[key] = _abs_path(data[key], key)
    if "agent_command" in data:
        values["agent_command"] = _command(data["agent_command"])
    if "metrics" in data:
        values["metrics"] = _metrics(data["metrics"])
    if "heatmap" in data:
        values["heatmap"] = _heatmap(data["heatmap"])
    config = HostConfig(**values)
    if check_model:
        config.model_params()  # every value and cross-field checks (e.g. pinned_decay >= decay)
    return config


_TOP_KEYS = ("budget", "min_free", "prefetch_rate", "psi_threshold", "interval", "hotset_interval", "cache_modes",
             "pinned_cap", "model",
             "runtime_dir", "log_dir", "agent_command", "metrics", "heatmap")
_METRICS_KEYS = ("listen", "ports", "tls", "basic_auth")
_TLS_KEYS = ("certfile", "keyfile", "client_cafile", "client_auth_required")
_AUTH_KEYS = ("username", "password_file")
_HEATMAP_KEYS = ("dir", "every", "blocks_per_pixel", "aspect")


def _key_text(key: object) -> str:
    """A key as it can be shown on one line."""
    return key if isinstance(key, str) and key.isprintable() else repr(key)


def _no_unknown(data: Mapping[Any, Any], known: tuple[str, ...], prefix: str) -> None:
    for key, value in data.items():
        if key not in known:
            raise ConfigError(f"{prefix}{_key_text(key)}", value, "unknown key (known: " + ", ".join(known) + ")")


def _section(value: object, key: str) -> Mapping[Any, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(key, value, "must be a mapping")
    return value


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
    section = _section(value, "model")
    if "interval" in section:
        raise ConfigError("model.interval", section["interval"], "set the top-level interval key instead")
    for key, value in section.items():
        if not isinstance(key, str) or not _PARAM_RE.match(key):
            raise ConfigError(f"model.{_key_text(key)}", value, "unknown model parameter")
    return MappingProxyType(dict(section))


def _abs_path(value: object, key: str) -> str:
    if not isinstance(value, str) or not value.startswith("/") or "\0" in value:
        raise ConfigError(key, value, "must be an absolute path")
    return os.path.normpath(value)


def _optional_path(value: object, key: str) -> str | None:
    return None if value is None else _abs_path(value, key)


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


def _ports(value: object) -> tuple[int, int]:
    key = "metrics.ports"
    if isinstance(value, bool):
        raise ConfigError(key, value, "must be a port or a range such as 9850-9999")
    if isinstance(value, int):
        first = last = value
    elif isinstance(value, str) and re.fullmatch(r"\s*[0-9]{1,5}\s*-\s*[0-9]{1,5}\s*", value):
        first, last = (int(p) for p in value.split("-"))
    elif (isinstance(value, list) and len(value) == 2
          and all(isinstance(p, int) and not isinstance(p, bool) for p in value)):
        first, last = value
    else:
        raise ConfigError(key, value, "must be a port or a range such as 9850-9999")
    if not 1 <= first <= last <= 65535:
        raise ConfigError(key, value, "ports must be in 1-65535, first <= last")
    return first, last


def _metrics(value: object) -> MetricsConfig:
    section = _section(value, "metrics")
    _no_unknown(section, _METRICS_KEYS, "metrics.")
    values: dict[str, Any] = {}
    if "listen" in section:
        import ipaddress  # here: the hook loads this module on every domain start

        listen = section["listen"]
        try:
            values["listen"] = str(ipaddress.ip_address(listen if isinstance(listen, str) else ""))
        except ValueError:
            raise ConfigError("metrics.listen", listen, "must be an IP address, e.g. 127.0.0.1 or ::1") from None
    if "ports" in section:
        values["port_first"], values["port_last"] = _ports(section["ports"])
    if section.get("tls") is not None:
        values["tls"] = _tls(_section(section["tls"], "metrics.tls"))
    if section.get("basic_auth") is not None:
        auth = _section(section["basic_auth"], "metrics.basic_auth")
        _no_unknown(auth, _AUTH_KEYS, "metrics.basic_auth.")
        username = auth.get("username")
        if not isinstance(username, str) or not username or ":" in username or not username.isprintable():
            raise ConfigError("metrics.basic_auth.username", username, "must be a non-empty name without ':'")
        values["basic_auth"] = MetricsBasicAuth(
            username, _abs_path(auth.get("password_file"), "metrics.basic_auth.password_file"))
    return MetricsConfig(**values)


def _tls(section: Mapping[Any, Any]) -> MetricsTLS:
    _no_unknown(section, _TLS_KEYS, "metrics.tls.")
    required = section.get("client_auth_required", False)
    if not isinstance(required, bool):
        raise ConfigError("metrics.tls.client_auth_required", required, "must be true or false")
    cafile = _optional_path(section.get("client_cafile"), "metrics.tls.client_cafile")
    if required and cafile is None:
        raise ConfigError("metrics.tls.client_auth_required", required, "needs client_cafile")
    return MetricsTLS(
        certfile=_abs_path(section.get("certfile"), "metrics.tls.certfile"),
        keyfile=_abs_path(section.get("keyfile"), "metrics.tls.keyfile"),
        client_cafile=cafile,
        client_auth_required=required,
    )


def _heatmap(value: object) -> HeatmapConfig:
    section = _section(value, "heatmap")
    _no_unknown(section, _HEATMAP_KEYS, "heatmap.")
    values: dict[str, Any] = {}
    if "dir" in section:
        values["dir"] = _abs_path(section["dir"], "heatmap.dir")
    if "every" in section:
        values["every"] = _whole(section["every"], "heatmap.every", 0)
    if "blocks_per_pixel" in section and section["blocks_per_pixel"] not in (None, "auto"):
        values["blocks_per_pixel"] = _whole(section["blocks_per_pixel"], "heatmap.blocks_per_pixel", 1)
    if "aspect" in section:
        aspect = section["aspect"]
        if isinstance(aspect, bool) or not isinstance(aspect, (int, float)) or not 0.01 <= aspect <= 100:
            raise ConfigError("heatmap.aspect", aspect, "must be a number in [0.01, 100] (width / height)")
        values["aspect"] = float(aspect)
    return HeatmapConfig(**values)


def _whole(value: object, key: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(key, value, f"must be a whole number >= {minimum}")
    return value
