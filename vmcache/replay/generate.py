"""Synthetic block traces: zoned, zipf, moving hot spot and stream (seeded, deterministic).

Every generator returns a :class:`~vmcache.replay.trace.Trace` of ``count``
requests of ``io_size`` bytes (offsets aligned to ``io_size``) over an image
of ``size`` bytes, issued at a steady ``rate`` (requests per second, so
request ``i`` is at ``i / rate`` seconds); each request is a write with
probability ``write_fraction``. The same arguments and ``seed`` give the
same trace on every machine (numpy's PCG64 generator).

- :func:`zoned`: ``zones`` contiguous hot zones, together ``hot_space`` of
  the image, take ``hot_share`` of the requests (uniform inside them); the
  rest fall uniformly over the whole image. Like fio's
  ``random_distribution=zoned``, hot data stays contiguous.
- :func:`zipf`: popularity of ``io_size`` units follows Zipf's law with
  exponent ``theta``, ranks scattered over the image by a random
  permutation (like fio's ``zipf``, which hashes offsets): hot data is *not*
  contiguous.
- :func:`stream`: a sequential read of the whole image, over and over
  (a backup or a scan); ``write_fraction`` defaults to 0.
- :func:`moving`: one contiguous hot window of ``hot_space`` of the image
  takes ``hot_share`` of the requests; it slides forward steadily, by its
  own width every ``dwell`` seconds (wrapping at the end of the image); the
  rest fall uniformly over the whole image.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numpy.typing import NDArray

from .trace import Trace

__all__ = ["zoned", "zipf", "moving", "stream", "requests", "GENERATORS"]


def _units(size: int, io_size: int) -> int:
    if io_size <= 0 or size < io_size:
        raise ValueError(f"need 0 < io_size <= size, got io_size={io_size}, size={size}")
    return size // io_size


def requests(rng: np.random.Generator, units: NDArray[np.int64], count: int, rate: float, io_size: int,
             write_fraction: float) -> Trace:
    """``count`` requests of ``io_size`` at ``units`` (in io_size units), ``rate`` a second, ``write_fraction`` writes.

    Raises ValueError for a rate that is not positive.
    """
    if rate <= 0:
        raise ValueError(f"rate must be more than 0, got {rate}")
    time = np.arange(count, dtype=np.float64) / rate
    write = rng.random(count) < write_fraction
    return Trace(time, write, units.astype(np.int64) * io_size, np.full(count, io_size, dtype=np.int64))


def _check_share(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")


def zoned(size: int, count: int, *, seed: int = 0, rate: float = 100.0, io_size: int = 4096,
          write_fraction: float = 0.2, zones: int = 4, hot_space: float = 0.1, hot_share: float = 0.9) -> Trace:
    """Contiguous hot zones; see the module docstring. Raises ValueError for impossible arguments."""
    n = _units(size, io_size)
    _check_share("hot_space", hot_space)
    _check_share("hot_share", hot_share)
    rng = np.random.default_rng(seed)
    zone_units = max(1, int(n * hot_space) // max(zones, 1))
    if zones < 1 or zones * zone_units > n:
        raise ValueError(f"cannot place {zones} zones of {zone_units} units in {n}")
    # non-overlapping zones: cut the free space into zones+1 random gaps
    free = n - zones * zone_units
    cuts = np.sort(rng.integers(0, free + 1, size=zones))
    starts = cuts + np.arange(zones) * zone_units
    hot = rng.random(count) < hot_share
    which = rng.integers(0, zones, size=count)
    inside = rng.integers(0, zone_units, size=count)
    anywhere = rng.integers(0, n, size=count)
    units = np.where(hot, starts[which] + inside, anywhere)
    return requests(rng, units, count, rate, io_size, write_fraction)


def zipf(size: int, count: int, *, seed: int = 0, rate: float = 100.0, io_size: int = 4096,
         write_fraction: float = 0.2, theta: float = 1.0) -> Trace:
    """Zipf popularity, scattered; see the module docstring. Raises ValueError for impossible arguments."""
    n = _units(size, io_size)
    if theta <= 0:
        raise ValueError(f"theta must be more than 0, got {theta}")
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** theta
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    ranks = np.minimum(np.searchsorted(cdf, rng.random(count), side="right"), n - 1)
    place = rng.permutation(n)
    return requests(rng, place[ranks], count, rate, io_size, write_fraction)


def moving(size: int, count: int, *, seed: int = 0, rate: float = 100.0, io_size: int = 4096,
           write_fraction: float = 0.2, hot_space: float = 0.1, hot_share: float = 0.9,
           dwell: float = 1200.0) -> Trace:
    """A sliding hot window; see the module docstring. Raises ValueError for impossible arguments."""
    n = _units(size, io_size)
    _check_share("hot_space", hot_space)
    _check_share("hot_share", hot_share)
    if dwell <= 0:
        raise ValueError(f"dwell must be more than 0, got {dwell}")
    rng = np.random.default_rng(seed)
    width = max(1, int(n * hot_space))
    time = np.arange(count, dtype=np.float64) / rate
    start = rng.integers(0, n)
    window = (start + np.floor(time / dwell * width).astype(np.int64)) % n
    hot = rng.random(count) < hot_share
    inside = rng.integers(0, width, size=count)
    anywhere = rng.integers(0, n, size=count)
    units = np.where(hot, (window + inside) % n, anywhere)
    return requests(rng, units, count, rate, io_size, write_fraction)


def stream(size: int, count: int, *, seed: int = 0, rate: float = 100.0, io_size: int = 4096,
           write_fraction: float = 0.0) -> Trace:
    """Sequential passes over the image from a random start; see the module docstring.

    Raises ValueError for impossible arguments.
    """
    n = _units(size, io_size)
    rng = np.random.default_rng(seed)
    units = (rng.integers(0, n) + np.arange(count, dtype=np.int64)) % n
    return requests(rng, units, count, rate, io_size, write_fraction)


GENERATORS: dict[str, Callable[..., Trace]] = {"zoned": zoned, "zipf": zipf, "moving": moving, "stream": stream}
