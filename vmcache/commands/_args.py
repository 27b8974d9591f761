"""argparse types shared by the commands: operator input to values, one-line errors."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

from ..errors import ConfigError
from ..units import parse_duration, parse_size

__all__ = ["size_arg", "duration_arg"]

T = TypeVar("T")


def _convert(parse: Callable[[], T]) -> T:
    """Run ``parse``; its ConfigError becomes the one-line error argparse shows for the option."""
    try:
        return parse()
    except ConfigError as err:
        raise argparse.ArgumentTypeError(err.reason) from err


def size_arg(text: str) -> int:
    """argparse type: a size such as 512M or 2GiB, in bytes."""
    return _convert(lambda: parse_size(text))


def duration_arg(text: str) -> float:
    """argparse type: a duration such as 5, 5s, 500ms, in seconds (> 0)."""
    return _convert(lambda: parse_duration(text, minimum=0.001))
