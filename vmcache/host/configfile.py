"""Reading /etc/vmcache/vmcache.yaml from disk, with a cache of validated configs for the hook.

Parsing and validation are pure (vmcache.settings.config); this module does
the file I/O around them. The libvirt hook loads the config on every domain
start: with ``cache_dir`` (the hook passes :data:`CACHE_DIR`) a valid config
is kept as JSON keyed by the file's identity and read back, without PyYAML,
while the file is unchanged. Cheap to import: no PyYAML, numpy or json
until a file is actually parsed or cached.
"""

from __future__ import annotations

import os
import stat

from ..errors import ConfigError, HostError
from ..settings.config import DEFAULT_PATH, HostConfig, config_from_json, config_to_json, parse_host_config
from .files import file_stem, write_atomic

__all__ = ["CACHE_DIR", "cache_path", "config_identity", "load_host_config", "load_or_salvage"]

#: Where load_host_config(cache_dir=CACHE_DIR) keeps validated configs (beside the
#: default runtime_dir: it is read before the config, and so its runtime_dir, is known).
CACHE_DIR = "/run/vmcache/config-cache"

_CACHE_VERSION = 2  # 2: the domains: rules
_SETTLE_NS = 2_000_000_000


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
        key = _identity(st)
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


def load_or_salvage(path: str = DEFAULT_PATH, *, check_model: bool = True,
                    cache_dir: str | None = None) -> tuple[HostConfig, ConfigError | None]:
    """The host config, or where it is not valid the defaults and the error.

    The defaults keep the file's ``runtime_dir`` and ``log_dir`` when they
    can be read at all: a broken config must not hide the agents (their
    status files, pidfiles) and logs of the directories it names.
    """
    try:
        return load_host_config(path, check_model=check_model, cache_dir=cache_dir), None
    except ConfigError as err:
        return _salvage(path), err


def _salvage(path: str) -> HostConfig:
    import dataclasses

    from ..settings.yamltext import abs_path, load_yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = load_yaml(f.read(), path)
    except (OSError, UnicodeDecodeError, ConfigError):
        return HostConfig()
    def kept(key: str, default: str) -> str:
        try:
            return abs_path(data[key], key) if isinstance(data, dict) and key in data else default
        except ConfigError:
            return default

    defaults = HostConfig()
    return dataclasses.replace(defaults, runtime_dir=kept("runtime_dir", defaults.runtime_dir),
                               log_dir=kept("log_dir", defaults.log_dir))


def _identity(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def config_identity(path: str) -> list[int] | None:
    """What tells one version of the config file from another (None: there is no file, or it cannot be seen)."""
    try:
        return _identity(os.stat(path))
    except OSError:
        return None


def cache_path(path: str, cache_dir: str = CACHE_DIR) -> str:
    """The cache file of the config at ``path``: its absolute path as a file name (``/`` as ``%2F``)."""
    return os.path.join(cache_dir, file_stem(os.path.abspath(path)) + ".json")


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
        return config_from_json(data["config"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _write_cache(cache: str, path: str, key: list[int], config: HostConfig) -> None:
    """Replace ``cache`` atomically with ``config`` if it survives the JSON round trip; never raises."""
    import json

    try:
        encoded = config_to_json(config)
        if config_from_json(json.loads(json.dumps(encoded))) != config:
            return  # e.g. model values JSON cannot carry exactly
        text = json.dumps({"version": _CACHE_VERSION, "path": os.path.abspath(path), "key": key,
                           "config": encoded}, sort_keys=True)
    except (ValueError, TypeError, KeyError):
        return
    try:
        write_atomic(cache, text, fsync=False, make_dirs=True, what="config cache")
    except HostError:
        pass  # only a cache: the next start parses the file again
