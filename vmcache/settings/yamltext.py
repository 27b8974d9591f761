"""YAML text to plain values for the host config, strictly, and the checks its sections share (pure).

:func:`load_yaml` refuses a key given twice (PyYAML would keep the last)
and returns every mapping as a :class:`Located` dict that knows the line it
starts on, so that a problem deep in a list (a bad rule under ``domains:``)
can name its line. Every problem is a one-line
:class:`~vmcache.errors.ConfigError`. PyYAML is imported only when a text
is parsed: the libvirt hook mostly reads the cache of validated configs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError

__all__ = ["Located", "load_yaml", "line_of", "key_text", "no_unknown", "section", "abs_path", "whole"]


class Located(dict[Any, Any]):
    """A mapping of the YAML text; ``line`` is the (1-based) line it starts on."""

    line: int | None = None


def line_of(value: object) -> int | None:
    """The line a mapping of :func:`load_yaml`'s result starts on (None for anything else)."""
    return value.line if isinstance(value, Located) else None


_strict_loader: type | None = None


def _loader() -> type:
    """SafeLoader that refuses duplicated keys and records each mapping's line (PyYAML imported here)."""
    global _strict_loader
    if _strict_loader is None:
        import yaml

        class StrictLoader(yaml.SafeLoader):
            pass

        StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
        _strict_loader = StrictLoader
    return _strict_loader


def _construct_mapping(loader: Any, node: Any, deep: bool = False) -> Located:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            duplicate = key in seen
        except TypeError:  # an unhashable key: let PyYAML report it
            break
        if duplicate:
            mark = key_node.start_mark
            raise ConfigError(key_text(key), None, f"key given twice (line {mark.line + 1})")
        seen.add(key)
    mapping = Located(loader.construct_mapping(node, deep=deep))
    mapping.line = node.start_mark.line + 1
    return mapping


def load_yaml(text: str, source: str) -> Any:
    """The value of YAML ``text`` (mappings as :class:`Located`); ConfigError naming ``source`` and the line."""
    import yaml

    try:
        return yaml.load(text, Loader=_loader())  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark
        lines = text.splitlines()
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        line = lines[mark.line] if mark is not None and mark.line < len(lines) else ""
        raise ConfigError(where, line.strip(), f"invalid YAML: {err.problem}") from None
    except yaml.YAMLError as err:  # e.g. a character YAML does not allow
        raise ConfigError(source, None, "invalid YAML: " + " ".join(str(err).split())) from None
    except RecursionError:
        raise ConfigError(source, None, "invalid YAML: nested too deeply") from None


def key_text(key: object) -> str:
    """A key as it can be shown on one line."""
    return key if isinstance(key, str) and key.isprintable() else repr(key)


def no_unknown(data: Mapping[Any, Any], known: tuple[str, ...], prefix: str) -> None:
    """ConfigError naming the first key of ``data`` not in ``known`` (``prefix`` before it)."""
    for key, value in data.items():
        if key not in known:
            raise ConfigError(f"{prefix}{key_text(key)}", value, "unknown key (known: " + ", ".join(known) + ")")


def section(value: object, key: str) -> Mapping[Any, Any]:
    """A mapping section (empty for null); ConfigError naming ``key`` for anything else."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(key, value, "must be a mapping")
    return value


def abs_path(value: object, key: str) -> str:
    """An absolute path, normalised; ConfigError naming ``key`` otherwise."""
    if not isinstance(value, str) or not value.startswith("/") or "\0" in value:
        raise ConfigError(key, value, "must be an absolute path")
    return os.path.normpath(value)


def whole(value: object, key: str, minimum: int) -> int:
    """A whole number >= ``minimum``; ConfigError naming ``key`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(key, value, f"must be a whole number >= {minimum}")
    return value
