"""argparse types shared by the commands: operator input to values, one-line errors."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from ..errors import ConfigError
from ..units import parse_duration, parse_size

__all__ = ["size_arg", "duration_arg"]


def _wrap(parse: Callable[[str], object]) -> Callable[[str], object]:
    def convert(text: str) -> object:
        try:
            return parse(text)
        except ConfigError as err:
            raise argparse.ArgumentTypeError(err.reason) from err

    return convert


def size_arg(text: str) -> int:
    """argparse type: a size such as 512M or 2GiB, in bytes."""
    return _wrap(lambda t: parse_size(t))(text)  # type: ignore[return-value]


def duration_arg(text: str) -> float:
    """argparse type: a duration such as 5, 5s, 500ms, in seconds (> 0)."""
    return _wrap(lambda t: parse_duration(t, minimum=0.001))(text)  # type: ignore[return-value]
