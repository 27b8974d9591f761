"""A real block trace as fio replays it inside the bench's guest: window, offset map, iolog, oracle.

Pure (numpy over the trace's columns; the caller reads and writes files).
Unit tested in tests/unit/test_bench_trace.py.

The traces (``../shared/traces``, README there) span far more than the
guest's 2 GiB disk (the web server's reaches 721 GiB, of which 4.1 GiB is
touched), so offsets are *compacted*: the disk is cut into 64 KiB chunks,
every stretch of untouched chunks of ``keep_gap`` (256 KiB) or more is cut
out and the rest is laid end to end in the trace's own order. What a
request reads within its chunks, the order of the chunks, and untouched
gaps shorter than ``keep_gap`` (the neighbours readahead and 1 MiB blocks
see) stay as they were; only the distance between regions farther apart
shrinks. The window is the longest prefix of the trace whose map fits the
disk (the first ~25 minutes of the web server's hour, 76,775 requests),
cut to ``REQUESTS`` so that an arm takes about two minutes; its first 60%
is the warm-up run (long enough for an agent to learn and load a hot set),
the rest the measured run.

fio replays each part with ``read_iolog`` (iolog version 2: ``add``/``open``,
one ``read``/``write`` line per request, ``close``) and
``replay_no_stall``: as fast as the guest goes, QD1, like the bench's other
workloads, so every arm replays the same requests and IOPS compare. The
trace's own timing is not kept: the hour passes in a few minutes, the order
of requests and so the reuse between them is what the cache sees.
"""

from __future__ import annotations

import csv
import gzip
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CHUNK = 64 << 10
KEEP_GAP = 256 << 10
BLOCK = 1 << 20
WARMUP_SHARE = 0.6    # of the window's requests, replayed before the measured part
REQUESTS = 36_000     # the window's length: the guest replays ~300-400 requests/s (57% of them O_SYNC writes)
TRACES = {"webserver": Path(__file__).resolve().parent.parent.parent / "shared" / "traces" / "webserver.csv.gz"}


@dataclass(frozen=True)
class Trace:
    """Requests in time order: seconds from the start, write or read, byte offset, byte length."""

    times: np.ndarray
    writes: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets)

    def head(self, n: int) -> "Trace":
        return Trace(self.times[:n], self.writes[:n], self.offsets[:n], self.lengths[:n])

    def part(self, start: int, end: int) -> "Trace":
        return Trace(self.times[start:end], self.writes[start:end], self.offsets[start:end],
                     self.lengths[start:end])


def load(path: Path) -> Trace:
    """A ``time,op,offset,length`` CSV (gzip'd if it ends in .gz), as ``vmcache replay`` reads it."""
    opener = gzip.open if path.suffix == ".gz" else open
    times, writes, offsets, lengths = [], [], [], []
    with opener(path, "rt") as f:
        rows = csv.reader(f)
        next(rows)
        for t, op, off, ln in rows:
            times.append(float(t))
            writes.append(op == "W")
            offsets.append(int(off))
            lengths.append(int(ln))
    return Trace(np.array(times), np.array(writes, dtype=bool), np.array(offsets, dtype=np.int64),
                 np.array(lengths, dtype=np.int64))


def _chunks(trace: Trace, chunk: int) -> np.ndarray:
    """The sorted distinct chunks the requests touch."""
    first = trace.offsets // chunk
    last = (trace.offsets + np.maximum(trace.lengths, 1) - 1) // chunk
    spans = last - first + 1
    every = np.repeat(first, spans) + (np.arange(spans.sum()) - np.repeat(np.cumsum(spans) - spans, spans))
    return np.unique(every)


@dataclass(frozen=True)
class OffsetMap:
    """Touched chunks (sorted) and where each lands on the guest's disk (chunk index there)."""

    chunks: np.ndarray
    targets: np.ndarray
    chunk: int

    @property
    def size(self) -> int:
        """Bytes of the guest's disk the map uses."""
        return int(self.targets[-1] + 1) * self.chunk if len(self.targets) else 0

    def __call__(self, offsets: np.ndarray) -> np.ndarray:
        c = offsets // self.chunk
        idx = np.searchsorted(self.chunks, c)
        if np.any(idx >= len(self.chunks)) or np.any(self.chunks[np.minimum(idx, len(self.chunks) - 1)] != c):
            raise ValueError("an offset outside the map's chunks")
        return self.targets[idx] * self.chunk + offsets % self.chunk


def offset_map(trace: Trace, chunk: int = CHUNK, keep_gap: int = KEEP_GAP) -> OffsetMap:
    """Compact the touched chunks: gaps of ``keep_gap`` bytes or more cut out, shorter ones kept, order kept."""
    chunks = _chunks(trace, chunk)
    if not len(chunks):
        return OffsetMap(chunks, chunks, chunk)
    gaps = np.diff(chunks) - 1
    kept = np.where(gaps * chunk < keep_gap, gaps, 0)
    targets = np.concatenate([[0], np.cumsum(kept + 1)])
    return OffsetMap(chunks, targets.astype(np.int64), chunk)


def fitting_prefix(trace: Trace, disk_bytes: int, chunk: int = CHUNK, keep_gap: int = KEEP_GAP) -> int:
    """The most requests from the start whose map fits ``disk_bytes`` (binary search: the size only grows)."""
    lo, hi = 0, len(trace)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if offset_map(trace.head(mid), chunk, keep_gap).size <= disk_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


def iolog(trace: Trace, mapped: np.ndarray, device: str = "/dev/vda") -> str:
    """fio's iolog version 2 replaying ``trace`` at the ``mapped`` offsets on ``device``."""
    ops = np.where(trace.writes, "write", "read")
    lines = ["fio version 2 iolog", f"{device} add", f"{device} open"]
    lines += [f"{device} {op} {off} {ln}" for op, off, ln in zip(ops, mapped.tolist(), trace.lengths.tolist())]
    lines.append(f"{device} close")
    return "\n".join(lines) + "\n"


def most_read(trace: Trace, mapped: np.ndarray, budget: int, block: int = BLOCK) -> list[tuple[int, int]]:
    """The oracle's pins: the ``block``-sized blocks the reads of ``trace`` read most bytes of (at ``mapped``
    offsets), up to ``budget`` bytes, merged into (start, length) runs in disk order."""
    reads = ~trace.writes
    starts, ends = mapped[reads], mapped[reads] + trace.lengths[reads]
    per_block: dict[int, int] = {}
    for s, e in zip(starts.tolist(), ends.tolist()):
        b = s // block
        while b * block < e:
            per_block[b] = per_block.get(b, 0) + min(e, (b + 1) * block) - max(s, b * block)
            b += 1
    ranked = sorted(per_block, key=lambda b: (-per_block[b], b))[:budget // block]
    runs: list[tuple[int, int]] = []
    for b in sorted(ranked):
        if runs and runs[-1][0] + runs[-1][1] == b * block:
            runs[-1] = (runs[-1][0], runs[-1][1] + block)
        else:
            runs.append((b * block, block))
    return runs


@dataclass(frozen=True)
class Replay:
    """What the guest replays: the warm-up and measured iologs, and the oracle's runs for the measured part."""

    warmup: str
    measured: str
    oracle: list[tuple[int, int]]
    requests: tuple[int, int]       # warm-up, measured
    trace_seconds: tuple[float, float]
    disk_used: int


def replay(trace: Trace, disk_bytes: int, warmup_share: float, budget: int, limit: int = 0) -> Replay:
    """Split the longest prefix that fits the disk (at most ``limit`` requests when given) into the warm-up
    (``warmup_share`` of the requests) and the measured part."""
    n = fitting_prefix(trace, disk_bytes)
    if limit:
        n = min(n, limit)
    window = trace.head(n)
    omap = offset_map(window)
    mapped = omap(window.offsets)
    cut = int(round(n * warmup_share))
    first, second = window.part(0, cut), window.part(cut, n)
    return Replay(iolog(first, mapped[:cut]), iolog(second, mapped[cut:]), most_read(second, mapped[cut:], budget),
                  (cut, n - cut), (float(first.times[-1] - first.times[0]) if cut else 0.0,
                                   float(second.times[-1] - second.times[0]) if n > cut else 0.0), omap.size)
