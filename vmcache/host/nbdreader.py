"""Read dirty bitmaps from a QEMU NBD export with libnbd ``block_status``.

QEMU shows each exported bitmap ``B`` as the NBD meta context
``qemu:dirty-bitmap:B``: extents whose flag bit 0 is set are dirty. A reply
may cover less than the length asked for, so the loop advances by what the
callbacks reported (the least over all contexts asked), never by the
request. Only the ranges the caller names are asked (where the image file
holds data, vmcache.host.nbdexport), each in requests of at most
``MAX_REQUEST`` bytes, pipelined (``WINDOW`` in flight). Every wait is
bounded: libnbd's asynchronous calls are polled with a timeout.

Extents are numpy ``int64`` arrays of shape ``(n, 2)``: ``(offset, length)``
rows, sorted, merged (no two rows touch or overlap; vmcache.model.extents).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Final

import numpy as np

from ..errors import BitmapReadError
from ..model.extents import empty_extents, merge_extents

__all__ = ["DIRTY_CONTEXT_PREFIX", "MAX_REQUEST", "read_dirty_extents", "requests"]

DIRTY_CONTEXT_PREFIX: Final = "qemu:dirty-bitmap:"
#: Largest block_status request (NBD counts are 32-bit).
MAX_REQUEST: Final = (1 << 32) - (1 << 20)
#: block_status requests in flight at once (QEMU's server handles 16 per client).
WINDOW: Final = 16
_STATE_DIRTY: Final = 1


class _Collector:
    """block_status callback of one request: keeps the raw answers, notes how far each context got.

    The answers are turned into arrays once, at the end (``_dirty_rows``):
    numpy per callback costs more than the NBD round trip.
    """

    def __init__(self, contexts: Sequence[str], parts: list[tuple[int, list[int]]]) -> None:
        self.contexts = set(contexts)
        self.parts = parts
        self.reached: dict[str, int] = {}

    def __call__(self, context: str, offset: int, entries: list[int], err: Any) -> int:
        if context not in self.contexts or not entries:
            return 0
        self.reached[context] = offset + sum(entries[0::2])
        if any(flags & _STATE_DIRTY for flags in entries[1::2]):
            self.parts.append((offset, entries))
        return 0


def _dirty_rows(parts: list[tuple[int, list[int]]]) -> list[np.ndarray]:
    rows = []
    for offset, entries in parts:
        pairs = np.asarray(entries, dtype=np.int64).reshape(-1, 2)
        ends = offset + np.cumsum(pairs[:, 0])
        dirty = (pairs[:, 1] & _STATE_DIRTY) != 0
        lengths = pairs[dirty, 0]
        rows.append(np.column_stack((ends[dirty] - lengths, lengths)))
    return rows


def requests(ranges: np.ndarray) -> deque[tuple[int, int]]:
    """``(offset, count)`` block_status requests covering ``ranges`` rows, none over ``MAX_REQUEST``."""
    return deque(
        (off, min(MAX_REQUEST, start + length - off))
        for start, length in ranges.tolist()
        for off in range(start, start + length, MAX_REQUEST)
    )


def _pipelined_status(
    handle: Any, contexts: Sequence[str], ranges: np.ndarray, deadline: float, export: str
) -> list[np.ndarray]:
    """block_status over ``ranges`` rows with up to ``WINDOW`` requests in flight.

    A request answered for less than asked is followed by one for the rest.
    """
    import nbd

    parts: list[tuple[int, list[int]]] = []
    todo = requests(ranges)
    inflight: dict[int, tuple[int, int, _Collector]] = {}
    while todo or inflight:
        while todo and len(inflight) < WINDOW:
            offset, count = todo.popleft()
            collector = _Collector(contexts, parts)
            inflight[handle.aio_block_status(count, offset, collector)] = (offset, count, collector)
        if time.monotonic() > deadline:
            raise BitmapReadError(f"NBD block_status on {export}: no answer in time")
        done = [cookie for cookie in inflight if handle.aio_command_completed(cookie)]
        if not done:
            try:
                handle.poll(max(1, int((deadline - time.monotonic()) * 1000)))
            except nbd.Error as err:
                raise BitmapReadError(f"NBD block_status on {export}: {err}") from err
            continue
        for cookie in done:
            offset, count, collector = inflight.pop(cookie)
            if set(collector.reached) != collector.contexts:
                raise BitmapReadError(f"NBD export {export}: no extents at offset {offset}")
            reached = min(collector.reached.values())
            if reached <= offset:
                raise BitmapReadError(f"NBD export {export}: no progress at offset {offset}")
            if reached < offset + count:
                todo.appendleft((reached, offset + count - reached))
    return _dirty_rows(parts)


def _wait(handle: Any, done: Any, deadline: float, what: str) -> None:
    import nbd

    while not done():
        left = deadline - time.monotonic()
        if left <= 0:
            raise BitmapReadError(f"NBD {what}: no answer in time")
        try:
            handle.poll(max(1, int(left * 1000)))
        except nbd.Error as err:
            raise BitmapReadError(f"NBD {what}: {err}") from err


def read_dirty_extents(
    socket_path: str,
    export: str,
    bitmaps: Sequence[str],
    length: int,
    *,
    timeout: float = 10.0,
    ranges: np.ndarray | None = None,
) -> np.ndarray:
    """Dirty extents of the union of ``bitmaps`` over ``[0, length)`` of ``export``.

    ``ranges``: the ``(offset, length)`` rows of ``[0, length)`` to ask
    (sorted, disjoint); None asks everywhere. Dirty bits outside them are
    not reported. Connects to the NBD server on the unix socket ``socket_path``. Raises
    BitmapReadError when the server, the export or a bitmap context is not
    there, or when an answer takes longer than ``timeout`` seconds.
    """
    import nbd

    contexts = [DIRTY_CONTEXT_PREFIX + name for name in bitmaps]
    deadline = time.monotonic() + timeout
    try:
        handle = nbd.NBD()
        for context in contexts:
            handle.add_meta_context(context)
        handle.set_export_name(export)
        handle.aio_connect_unix(socket_path)
    except nbd.Error as err:
        raise BitmapReadError(f"NBD connect {socket_path} export {export}: {err}") from err
    try:
        _wait(handle, lambda: not handle.aio_is_connecting(), deadline, "connect")
        if not handle.aio_is_ready():
            raise BitmapReadError(f"NBD connect {socket_path} export {export}: handshake failed")
        for context in contexts:
            if not handle.can_meta_context(context):
                raise BitmapReadError(f"NBD export {export} has no context {context}")
        size = handle.get_size()
        end = min(length, size)
        asked = np.array([[0, end]], dtype=np.int64) if ranges is None else _clip(ranges, end)
        parts = _pipelined_status(handle, contexts, asked, deadline, export)
    except nbd.Error as err:
        raise BitmapReadError(f"NBD read of {export}: {err}") from err
    finally:
        _close(handle)
    if not parts:
        return empty_extents()
    extents = merge_extents(np.concatenate(parts))
    # The last extent may run past the length asked for: clip it.
    if len(extents):
        over = extents[:, 0] + extents[:, 1] > end
        extents[over, 1] = end - extents[over, 0]
        extents = extents[extents[:, 1] > 0]
    return extents


def _clip(ranges: np.ndarray, end: int) -> np.ndarray:
    rows = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
    ends = np.minimum(rows[:, 0] + rows[:, 1], end)
    keep = ends > rows[:, 0]
    return np.column_stack((rows[keep, 0], ends[keep] - rows[keep, 0]))


def _close(handle: Any) -> None:
    import nbd

    # libnbd closes the socket when the handle is freed; shutdown() first
    # tells the server politely.
    try:
        if handle.aio_is_ready():
            handle.shutdown()
    except nbd.Error:
        pass
