"""``vmcache scan IMAGE``: how much of an image is in the page cache (like fincore/vmtouch).

By default one cachestat(2) call over the whole file answers (resident,
dirty, writeback, evicted and recently evicted pages), so a 1 TiB image
answers in microseconds and the command imports no numpy. ``--blocks``
adds the per-block counts, which need the cachestat + mincore scan of
``vmcache.host.pagecache``. Without cachestat (older kernel, seccomp, a file
system without it) or with ``--method mincore`` every page is asked with
mincore(2), as vmtouch does.
"""

from __future__ import annotations

import argparse
import errno
import time

from ..errors import ConfigError, PageCacheError
from ..host.cachestat import PAGE_SIZE, file_cachestat
from ..units import format_size
from ._args import size_arg

TYPE_CHECKING = False  # typing costs ~3 ms to import; the annotations are strings
if TYPE_CHECKING:
    from typing import Any

NAME = "scan"
HELP = "show how much of an image file is resident in the host page cache"
LOGS = False  # nothing on this command's path logs: the CLI need not import logging

DEFAULT_BLOCK = 1 << 20
_METHODS = {"auto": None, "cachestat": True, "mincore": False}
# cachestat errnos after which "auto" falls back to mincore: no cachestat in
# this kernel or sandbox (ENOSYS, EPERM, EINVAL), or not for this file system.
_FALLBACK_ERRNOS = frozenset({errno.ENOSYS, errno.EPERM, errno.EINVAL, errno.EOPNOTSUPP})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("image", help="image file (or any regular file)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--blocks", action="store_true",
                        help="also count the resident and fully resident blocks (a per-block scan)")
    parser.add_argument("--block-size", type=size_arg, default=None,
                        help="block size for --blocks (implies it), a multiple of the page size (default 1MiB)")
    parser.add_argument("--method", choices=sorted(_METHODS), default="auto",
                        help="cachestat (auto, the default when the kernel has cachestat; with --blocks "
                             "plus mincore in the partly cached ranges), or mincore over every page")


def _whole_file(path: str, method: str) -> dict[str, Any] | None:
    """Whole-file figures from one cachestat call; None when ``auto`` must fall back to mincore."""
    try:
        size, stat = file_cachestat(path)
    except PageCacheError as err:
        if method == "auto" and err.errno in _FALLBACK_ERRNOS:
            return None
        raise
    return {
        "path": path,
        "size_bytes": size,
        "resident_pages": stat.nr_cache,
        "method": "cachestat",
        "nr_cache": stat.nr_cache,
        "nr_dirty": stat.nr_dirty,
        "nr_writeback": stat.nr_writeback,
        "nr_evicted": stat.nr_evicted,
        "nr_recently_evicted": stat.nr_recently_evicted,
    }


def _per_block(path: str, block_size: int, method: str, blocks: bool) -> dict[str, Any]:
    """The cachestat + mincore scan of ``vmcache.host.pagecache`` (imports numpy)."""
    from ..host.pagecache import scan_residency  # numpy: only for --blocks or mincore

    try:
        res = scan_residency(path, block_size, use_cachestat=_METHODS[method])
    except ConfigError as err:
        raise ConfigError("--" + err.key.replace("_", "-"), err.value, err.reason) from None
    out: dict[str, Any] = {
        "path": res.path,
        "size_bytes": res.size_bytes,
        "resident_pages": res.resident_pages,
        "method": res.method,
        "nr_cache": res.nr_cache,
        "nr_dirty": res.nr_dirty,
        "nr_writeback": res.nr_writeback,
        "nr_evicted": res.nr_evicted,
        "nr_recently_evicted": res.nr_recently_evicted,
    }
    if blocks:
        listed = res.blocks  # the resident blocks only: a 64 TiB image is not 64M entries
        out.update(
            block_size=res.block_size,
            blocks=res.nblocks,
            blocks_resident=int((listed.value > 0).sum()),
            blocks_full=int((listed.value == 1.0).sum()),
        )
    return out


def scan(path: str, *, method: str = "auto", block_size: int | None = None, blocks: bool = False) -> dict[str, Any]:
    """The figures ``vmcache scan`` prints, as the JSON object's keys (without elapsed_seconds).

    Raises ConfigError for a bad ``--block-size``, PageCacheError when the
    file cannot be opened or asked (or ``method`` is "cachestat" and the
    kernel has none).
    """
    blocks = blocks or block_size is not None
    found = None if blocks or method == "mincore" else _whole_file(path, method)
    if found is None:
        found = _per_block(path, block_size or DEFAULT_BLOCK, method, blocks)
    size, resident = found["size_bytes"], found["resident_pages"]
    total_pages = -(-size // PAGE_SIZE)
    return {
        "path": found["path"],
        "size_bytes": size,
        "page_size": PAGE_SIZE,
        "total_pages": total_pages,
        "resident_pages": resident,
        "resident_bytes": resident * PAGE_SIZE,
        "resident_percent": round(100.0 * resident / total_pages, 6) if total_pages else 0.0,
        **found,  # method, cachestat counters (None for mincore), blocks_* with --blocks
    }


def run(args: argparse.Namespace) -> int:
    if args.blocks or args.block_size is not None or args.method == "mincore":
        from ..host import pagecache  # noqa: F401  (numpy) imported before the clock starts
    started = time.perf_counter()
    out = scan(args.image, method=args.method, block_size=args.block_size, blocks=args.blocks)
    out["elapsed_seconds"] = round(time.perf_counter() - started, 6)
    if args.json:
        import json  # ~2 ms: only when asked for

        print(json.dumps(out))
        return 0
    print(f"           File: {out['path']}")
    print(f"           Size: {format_size(out['size_bytes'])} ({out['size_bytes']} bytes)")
    print(f" Resident Pages: {out['resident_pages']}/{out['total_pages']}  "
          f"{format_size(out['resident_bytes'])}/{format_size(out['total_pages'] * PAGE_SIZE)}  "
          f"{out['resident_percent']:.3g}%")
    if "blocks" in out:
        print(f"         Blocks: {out['blocks_resident']}/{out['blocks']} touched, {out['blocks_full']} full "
              f"({format_size(out['block_size'])} each)")
    if out["nr_dirty"] is not None:
        print(f"    Dirty Pages: {out['nr_dirty']}  writeback {out['nr_writeback']}")
        print(f"  Evicted Pages: {out['nr_evicted']}  recently {out['nr_recently_evicted']}")
    print(f"        Elapsed: {out['elapsed_seconds']:.4f} seconds ({out['method']})")
    return 0
