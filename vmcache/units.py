"""Parsing and printing of sizes and durations given by operators (pure)."""

from __future__ import annotations

import math
import re

from .errors import ConfigError

__all__ = ["parse_size", "format_size", "parse_duration", "parse_fraction", "number_or_text"]

# libvirt's convention: a bare letter or an "iB" suffix is binary, "B" after
# a letter is decimal (K = KiB = 1024, KB = 1000).
_BINARY = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50, "e": 1 << 60}
_DECIMAL = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15, "eb": 10**18}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")
MAX_SIZE = 1 << 62
_SIZE_HINT = "not a size (use e.g. 4096, 512M, 2GiB, 1.5G)"


def parse_size(value: object, *, key: str = "size", allow_zero: bool = True) -> int:
    """Return ``value`` as a whole number of bytes.

    Accepts an int or a string such as ``4096``, ``512M``, ``512MiB``,
    ``2G``, ``1.5GiB``, ``500MB`` (decimal). Raises ConfigError naming
    ``key`` for anything else, for negative or absurd values.
    """
    if isinstance(value, bool):
        raise ConfigError(key, value, _SIZE_HINT)
    if isinstance(value, int):
        number: float = value
        scale = 1
    elif isinstance(value, str):
        match = _SIZE_RE.match(value)
        if not match:
            raise ConfigError(key, value, _SIZE_HINT)
        number = float(match.group(1))
        unit = match.group(2).lower()
        if unit in _DECIMAL:
            scale = _DECIMAL[unit]
        else:
            unit = unit[:-2] if unit.endswith("ib") else unit
            if unit not in _BINARY:
                raise ConfigError(key, value, _SIZE_HINT)
            scale = _BINARY[unit]
    else:
        raise ConfigError(key, value, _SIZE_HINT)
    if number < 0:
        raise ConfigError(key, value, "must not be negative")
    size = number * scale
    if not math.isfinite(size) or size > MAX_SIZE:
        raise ConfigError(key, value, "too large")
    result = int(size)
    if result == 0 and not allow_zero:
        raise ConfigError(key, value, "must be more than 0")
    return result


def format_size(size: int | float) -> str:
    """Print a byte count the way operators write it: ``1.5GiB``, ``512MiB``."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024 or unit == "PiB":
            if unit == "B":
                return f"{int(value)}B"
            text = f"{value:.1f}".rstrip("0").rstrip(".")
            return f"{text}{unit}"
        value /= 1024
    raise AssertionError("unreachable")


_DURATION_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m|h|d|)\s*$")
_DURATION_SCALE = {"ms": 0.001, "s": 1.0, "": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(value: object, *, key: str = "interval", minimum: float = 0.0) -> float:
    """Return ``value`` in seconds: a number, or ``500ms``, ``5s``, ``2m``, ``1h``, ``30d``.

    Raises ConfigError naming ``key`` when it is not a duration or is below
    ``minimum``.
    """
    if isinstance(value, bool):
        raise ConfigError(key, value, "not a duration (use e.g. 5, 5s, 500ms, 2m)")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str) and (match := _DURATION_RE.match(value)):
        seconds = float(match.group(1)) * _DURATION_SCALE[match.group(2)]
    else:
        raise ConfigError(key, value, "not a duration (use e.g. 5, 5s, 500ms, 2m)")
    if not math.isfinite(seconds) or seconds < minimum:
        raise ConfigError(key, value, f"must be at least {minimum:g}s")
    return seconds


def parse_fraction(value: object, *, key: str, low: float = 0.0, high: float = 1.0) -> float:
    """Return ``value`` as a float in ``[low, high]``; ConfigError naming ``key`` otherwise."""
    if isinstance(value, bool):
        raise ConfigError(key, value, "not a number")
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError) as err:
        raise ConfigError(key, value, "not a number") from err
    if not math.isfinite(number) or not low <= number <= high:
        raise ConfigError(key, value, f"must be between {low:g} and {high:g}")
    return number


_INT_RE = re.compile(r"^[+-]?[0-9]+$")
_FLOAT_RE = re.compile(r"^[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?$")


def number_or_text(text: str) -> int | float | str:
    """``"3"`` -> 3, ``"0.9"`` -> 0.9; anything else (``"1M"``, ``"10s"``) stays text.

    For parameters given as strings (XML attributes, ``--option VALUE``)
    whose validation, later, wants numbers as numbers.
    """
    if _INT_RE.match(text):
        return int(text)
    if _FLOAT_RE.match(text):
        return float(text)
    return text
