"""Block traces: the replay CSV format, its reader and writer, and fio iolog import.

The CSV format (one request per line, after a header line)::

    time,op,offset,length
    0.000000,R,1048576,4096
    0.005000,W,65536,8192

- ``time``: seconds since the start of the trace (a float, not decreasing);
- ``op``: ``R`` (read) or ``W`` (write), upper or lower case;
- ``offset``, ``length``: bytes in the image file (whole numbers,
  ``offset >= 0``, ``length > 0``).

Blank lines and lines starting with ``#`` are ignored. A line that breaks
these rules stops the reader with a :class:`TraceFormatError` naming the
file and line number.

fio's ``--write_iolog`` output is imported by :func:`read_fio_iolog`:
version 2 (``filename action offset length``; ``wait`` lines advance time
by microseconds) and version 3 (a leading timestamp in microseconds since
the start of the run, as fio 3.33 writes it). ``read`` and ``write`` lines
become requests; ``add``/``open``/``close``/``sync``/``datasync``/``trim``
are skipped. A version 2 log without ``wait`` lines has no timing: its
requests are spaced ``1 / rate`` seconds apart.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from numpy.typing import NDArray

from ..errors import VmcacheError

__all__ = ["Trace", "TraceFormatError", "read_csv", "write_csv", "read_fio_iolog", "read_trace", "HEADER"]

HEADER = "time,op,offset,length"
_FIO_IO = {"read": False, "write": True}
_FIO_SKIPPED = {"add", "open", "close", "sync", "datasync", "trim"}


class TraceFormatError(VmcacheError):
    """A trace file line is not acceptable; ``str()`` is ``FILE:LINE: reason``."""

    def __init__(self, path: str, line: int, reason: str) -> None:
        super().__init__(path, line, reason)
        self.path = path
        self.line = line
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


@dataclass(frozen=True)
class Trace:
    """Requests in time order: parallel arrays, one entry per request."""

    time: NDArray[np.float64]
    write: NDArray[np.bool_]
    offset: NDArray[np.int64]
    length: NDArray[np.int64]

    def __post_init__(self) -> None:
        n = len(self.time)
        if not (len(self.write) == len(self.offset) == len(self.length) == n):
            raise ValueError("trace arrays must have the same length")

    def __len__(self) -> int:
        return len(self.time)

    @property
    def end(self) -> int:
        """One past the last byte any request touches (0 for an empty trace)."""
        return int((self.offset + self.length).max()) if len(self) else 0

    @property
    def duration(self) -> float:
        return float(self.time[-1] - self.time[0]) if len(self) else 0.0

    def since(self, start: float) -> Trace:
        """The requests from ``start`` seconds on, their times shifted so that ``start`` is 0 (a VM that
        began its hour there)."""
        keep = self.time >= start
        return Trace(self.time[keep] - start, self.write[keep], self.offset[keep], self.length[keep])

    @classmethod
    def from_lists(cls, time: list[float], write: list[bool], offset: list[int], length: list[int]) -> Trace:
        return cls(np.asarray(time, dtype=np.float64), np.asarray(write, dtype=bool),
                   np.asarray(offset, dtype=np.int64), np.asarray(length, dtype=np.int64))


def write_csv(trace: Trace, path: str | os.PathLike[str]) -> None:
    """Write ``trace`` in the CSV format (times with microsecond precision)."""
    ops = np.where(trace.write, "W", "R")
    with open(path, "w", encoding="ascii", newline="\n") as out:
        out.write(HEADER + "\n")
        for t, op, off, ln in zip(trace.time.tolist(), ops.tolist(), trace.offset.tolist(), trace.length.tolist()):
            out.write(f"{t:.6f},{op},{off},{ln}\n")


def read_csv(path: str | os.PathLike[str]) -> Trace:
    """Read a CSV trace; raise TraceFormatError (file, line, reason) for a bad line, OSError if unreadable."""
    name = os.fspath(path)
    with open(path, encoding="utf-8", errors="replace") as src:
        return _parse_csv(src, name)


def _parse_csv(src: io.TextIOBase, name: str) -> Trace:
    times: list[float] = []
    writes: list[bool] = []
    offsets: list[int] = []
    lengths: list[int] = []
    header_seen = False
    last = float("-inf")
    for number, raw in enumerate(src, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if not header_seen:
            if line.replace(" ", "").lower() != HEADER:
                raise TraceFormatError(name, number, f"expected the header {HEADER!r}, got {_short(line)}")
            header_seen = True
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 4:
            raise TraceFormatError(name, number, f"expected 4 fields (time,op,offset,length), got {len(fields)}")
        t = _number(fields[0], float, name, number, "time")
        op = fields[1].upper()
        if op not in ("R", "W"):
            raise TraceFormatError(name, number, f"op must be R or W, got {_short(fields[1])}")
        off = _number(fields[2], int, name, number, "offset")
        ln = _number(fields[3], int, name, number, "length")
        if not np.isfinite(t) or t < 0:
            raise TraceFormatError(name, number, f"time must be a finite number >= 0, got {_short(fields[0])}")
        if t < last:
            raise TraceFormatError(name, number, f"time goes backwards ({t:g} after {last:g})")
        if off < 0:
            raise TraceFormatError(name, number, f"offset must not be negative, got {off}")
        if ln <= 0:
            raise TraceFormatError(name, number, f"length must be more than 0, got {ln}")
        last = t
        times.append(t)
        writes.append(op == "W")
        offsets.append(off)
        lengths.append(ln)
    if not header_seen:
        raise TraceFormatError(name, 1, f"empty trace: expected the header {HEADER!r}")
    return Trace.from_lists(times, writes, offsets, lengths)


def read_fio_iolog(path: str | os.PathLike[str], *, filename: str | None = None, rate: float = 1000.0) -> Trace:
    """Import an fio iolog (version 2 or 3) for one file.

    ``filename``: the file whose requests to take; needed only when the log
    names more than one. ``rate``: requests per second assumed for a
    version 2 log without ``wait`` lines. Raises TraceFormatError for a bad
    line, an unknown version or an ambiguous file, OSError if unreadable.
    """
    name = os.fspath(path)
    with open(path, encoding="utf-8", errors="replace") as src:
        lines = src.read().splitlines()
    if not lines or not lines[0].startswith("fio version "):
        raise TraceFormatError(name, 1, "not an fio iolog (expected 'fio version 2 iolog' or 'fio version 3 iolog')")
    version = lines[0].split()[2:3]
    if version not in (["2"], ["3"]):
        raise TraceFormatError(name, 1, f"unsupported fio iolog version: {_short(lines[0])}")
    v3 = version == ["3"]
    rows: list[tuple[float, str, bool, int, int]] = []
    files: list[str] = []
    clock = 0.0  # v2: microseconds from wait lines
    waits = False
    for number, raw in enumerate(lines[1:], 2):
        parts = raw.split()
        if not parts:
            continue
        stamp = None
        if v3:
            stamp = _number(parts[0], int, name, number, "timestamp")
            parts = parts[1:]
        if len(parts) < 2:
            raise TraceFormatError(name, number, f"expected 'filename action [offset length]', got {_short(raw)}")
        fname, action = parts[0], parts[1]
        if action in _FIO_SKIPPED:
            if action == "add" and fname not in files:
                files.append(fname)
            continue
        if action == "wait" and not v3 and len(parts) == 4:
            clock += _number(parts[2], int, name, number, "wait")
            waits = True
            continue
        if action not in _FIO_IO:
            raise TraceFormatError(name, number, f"unknown fio iolog action {_short(action)}")
        if len(parts) != 4:
            raise TraceFormatError(name, number, f"expected 'filename {action} offset length', got {_short(raw)}")
        off = _number(parts[2], int, name, number, "offset")
        ln = _number(parts[3], int, name, number, "length")
        if off < 0 or ln <= 0:
            raise TraceFormatError(name, number, "offset must be >= 0 and length > 0")
        usec = float(stamp) if stamp is not None else clock
        rows.append((usec / 1e6, fname, _FIO_IO[action], off, ln))
    return _fio_trace(rows, name, filename, rate if not v3 and not waits else None)


def _fio_trace(rows: list[tuple[float, str, bool, int, int]], name: str, filename: str | None,
               rate: float | None) -> Trace:
    """The requests of one file as a Trace, from 0 s; ``rate``: requests per second when the log has no times.

    Raises TraceFormatError when the file is ambiguous or has no requests.
    """
    used = sorted({r[1] for r in rows})
    if filename is None and len(used) > 1:
        raise TraceFormatError(name, 1, "the log has requests for several files, choose one: " + ", ".join(used))
    if filename is not None:
        rows = [r for r in rows if r[1] == filename]
        if not rows:
            raise TraceFormatError(name, 1, f"no requests for {filename!r} (files: {', '.join(used) or 'none'})")
    if rate is not None:
        rows = [(i / rate, *r[1:]) for i, r in enumerate(rows)]
    rows.sort(key=lambda r: r[0])  # stable: equal stamps keep log order
    if rows:
        t0 = min(0.0, rows[0][0])
        rows = [(r[0] - t0, *r[1:]) for r in rows]
    return Trace.from_lists([r[0] for r in rows], [r[2] for r in rows], [r[3] for r in rows], [r[4] for r in rows])


def read_trace(path: str | os.PathLike[str], *, filename: str | None = None) -> Trace:
    """Read a CSV trace or an fio iolog, told apart by the first line."""
    with open(path, encoding="utf-8", errors="replace") as src:
        first = src.readline()
    if first.startswith("fio version "):
        return read_fio_iolog(path, filename=filename)
    return read_csv(path)


_N = TypeVar("_N", int, float)


def _number(text: str, kind: type[_N], name: str, line: int, what: str) -> _N:
    try:
        return kind(text)
    except ValueError:
        expected = "a whole number" if kind is int else "a number"
        raise TraceFormatError(name, line, f"{what} must be {expected}, got {_short(text)}") from None


def _short(text: str) -> str:
    return repr(text if len(text) <= 40 else text[:37] + "...")
