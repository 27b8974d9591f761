"""Where an image file holds data: its allocated ranges, by SEEK_DATA/SEEK_HOLE.

A guest write that QEMU completed has allocated its bytes in the image file
(a hole filled, a qcow2 cluster appended, or delayed allocation that
SEEK_DATA already counts), so the dirty-bitmap read asks QEMU only about
these ranges (vmcache.host.nbdexport). A write QEMU turned into a hole punch
or a zeroed range (write-zeroes, discard, detect-zeroes) leaves a hole or an
unwritten extent: it is not data, and no page of it is in the page cache.

``data_extents`` answers None where holes cannot be told apart from data -
a block device, a file that cannot be opened, a file system without
SEEK_DATA - and the caller asks over the whole length, as before.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Final, NamedTuple

import numpy as np

from ..model.extents import merge_extents

__all__ = ["MAX_STEPS", "STRIDE", "FileData", "data_extents"]

#: Data ranges are widened to this: holes smaller than a stride are not walked one by one.
STRIDE: Final = 64 << 20
#: Steps (two lseeks each) walked at most; from there to its end the file counts as data.
MAX_STEPS: Final = 4096
#: The walk goes on past ``_JUDGE_AFTER`` steps only while its steps skipped this much hole on average:
#: a step (~1.3 us) is worth it when it spares part of a 4 GiB block_status request (~10-20 us).
_SKIP_PER_STEP: Final = 256 << 20
_JUDGE_AFTER: Final = 256


class FileData(NamedTuple):
    """Where a file holds data: ``(offset, length)`` rows, its size, and which file it was (st_dev, st_ino)."""

    extents: np.ndarray
    size: int
    identity: tuple[int, int]


def data_extents(path: str, *, stride: int = STRIDE, max_steps: int = MAX_STEPS) -> FileData | None:
    """The data ranges of the regular file ``path`` widened to ``stride`` multiples, or None (see module).

    Sorted, merged rows covering every data byte (a superset: whole strides
    around each data segment). Costs two lseeks a step, a step per data
    segment that does not end in the stride of the previous one; after
    ``max_steps``, or once the steps skip too little hole to pay for
    themselves (data scattered everywhere), the rest of the file counts as
    data. Never raises: every failure means "cannot tell" (None).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None
        return FileData(_walk(fd, info.st_size, stride, max_steps), info.st_size, (info.st_dev, info.st_ino))
    except OSError:
        return None
    finally:
        os.close(fd)


def _walk(fd: int, size: int, stride: int, max_steps: int) -> np.ndarray:
    """Data rows of ``[0, size)`` in whole strides; OSError when the file system has no SEEK_DATA (EINVAL)."""
    rows: list[tuple[int, int]] = []
    offset = skipped = 0
    for step in range(max_steps):
        if offset >= size or (step >= _JUDGE_AFTER and skipped < step * _SKIP_PER_STEP):
            break
        start = _next_data(fd, offset)
        if start is None or start >= size:
            offset = size  # no data from offset to the end
            break
        end = os.lseek(fd, start, os.SEEK_HOLE)
        first = start - start % stride
        skipped += max(0, first - offset)
        offset = min(-(-max(end, start + 1) // stride) * stride, size)
        rows.append((first, offset - first))
    if offset < size:  # stopped early: the rest counts as data
        rows.append((offset, size - offset))
    return merge_extents(np.array(rows, dtype=np.int64).reshape(-1, 2))


def _next_data(fd: int, offset: int) -> int | None:
    """Where the next data at or after ``offset`` starts; None when there is none."""
    try:
        return os.lseek(fd, offset, os.SEEK_DATA)
    except OSError as err:
        if err.errno == errno.ENXIO:
            return None
        raise
