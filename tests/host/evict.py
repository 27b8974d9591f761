"""Evict files from this machine's page cache and check that none of their pages is left (a cold boot's cache).

    python3 tests/host/evict.py FILE...     (from the checkout, with PYTHONPATH=.)

tests/host/cleanhost.sh runs it between the two boots of its reboot check,
on the real files under the container's overlay (the upper directory: an
overlayfs file's cachestat counts the overlay's own cache, not the real
file's). Each file is written back, dropped (POSIX_FADV_DONTNEED) and
asked again with cachestat(2); any page still cached fails the run, since
the check after the boot would then not start cold. Standard library and
vmcache.host.cachestat only: it runs with this machine's python3, no venv.
"""

from __future__ import annotations

import os
import sys

from vmcache.host.cachestat import PAGE_SIZE, file_cachestat


def evict(path: str) -> int:
    """Write ``path`` back and drop its pages; the bytes still cached after (0 when it is cold)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return file_cachestat(path)[1].nr_cache * PAGE_SIZE


def main(paths: list[str]) -> int:
    if not paths:
        print("evict: no files", file=sys.stderr)
        return 2
    left = {path: evict(path) for path in paths}
    warm = {path: n for path, n in left.items() if n}
    for path, n in warm.items():
        print(f"evict: {path}: {n} bytes still cached", file=sys.stderr)
    if not warm:
        print(f"evict: {len(paths)} files, {sum(os.path.getsize(p) for p in paths) >> 20} MiB: no page cached")
    return 1 if warm else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
