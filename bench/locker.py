"""Lock byte ranges of a file in the page cache until stopped: the bench's oracle for scattered hot blocks.

    python3 bench/locker.py FILE RANGES      # RANGES: a text file, one "START LENGTH" (bytes) a line

What ``vmtouch -l -p START-END`` does for one range, for many: each range is
mapped read-only, marked ``MADV_RANDOM`` (mlock then faults in exactly the
range, no read-around beside it) and mlocked; then it sleeps until SIGTERM or
SIGINT. Runs as root (CAP_IPC_LOCK). Standard library only, so any Python 3
runs it inside the arm's memory cgroup.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import signal
import sys

MADV_RANDOM = 1


def main() -> int:
    path, ranges = sys.argv[1], sys.argv[2]
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    with open(ranges) as f:
        spans = [tuple(int(v) for v in line.split()) for line in f if line.strip()]
    for start, length in spans:
        addr = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap {start}+{length}")
        libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), MADV_RANDOM)
        if libc.mlock(ctypes.c_void_p(addr), ctypes.c_size_t(length)) != 0:
            raise OSError(ctypes.get_errno(), f"mlock {start}+{length}")
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    return 0


if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    sys.exit(main())
