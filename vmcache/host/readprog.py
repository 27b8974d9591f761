"""The read-counting BPF programs' shared parts, and the tracepoint set's programs (their maps: readmaps.py).

Written with :mod:`vmcache.host.bpfasm`. Every program starts with the same
filter (the process is a QEMU in ``qemus``, known by its tgid in its own
pid namespace: :mod:`vmcache.host.pidns`) and, for a file, a second (the
file is in ``meta``) that end it for everything else. The tracepoint set
(Linux 6.12+; :mod:`vmcache.host.probeprog` has the ``filemap_read``
probe's programs, which share the maps, the miss program and the counting
below) does on each event:

- ``mm_filemap_get_pages`` (a buffered read gets a batch of folios; one
  read of many pages fires it once per batch, each time with the read's
  ``last_index``): a read whose thread's previous event was the same file
  with the same ``last_index`` and a lower ``index`` is that read going
  on, and is not counted again; otherwise it is a new read and its pages
  ``index..last_index`` are counted. Either way it ends the thread's
  readahead mark.
- ``page_cache_sync_ra`` / ``page_cache_async_ra`` (a read is starting
  readahead): marks the thread as reading that file.
- ``mm_filemap_add_to_page_cache`` (a folio entered the cache): counted
  as missed when its thread carries that file's readahead mark, so pages
  QEMU's writes put in the cache are not taken for reads.

Counts go to the file's current count map (``files`` holds two per file,
``meta`` says which one), per block of ``pages per block`` pages: a span
within one block adds to it, a span over more blocks adds its partial
first and last blocks and marks the whole blocks between with a
difference pair (+ppb after the first, -ppb at the last) that
vmcache.host.readcount decodes, so a 4 GiB read costs what a 4 KiB one
does.
"""

from __future__ import annotations

from collections.abc import Callable

from . import bpf
from .bpf import NOEXIST
from .bpfasm import LOOKUP, NS_PID_TGID, PID_TGID, UPDATE, Asm
from .pidns import INIT_INO, SLOTS
from .readmaps import Maps
from .tracefs import Tracepoint

__all__ = ["EVENTS", "programs", "program", "KeyLoader", "record_key", "watched", "mark_reading",
           "unmark_reading", "added", "count_read"]

#: The tracepoints, in the order the program's links are made.
EVENTS = (("filemap", "mm_filemap_get_pages"), ("filemap", "mm_filemap_add_to_page_cache"),
          ("readahead", "page_cache_sync_ra"), ("readahead", "page_cache_async_ra"))
# Stack slots (offsets from r10).
_TID, _KEY, _BLOCK, _TV, _CV = -4, -24, -32, -72, -104
_S, _E, _PPB, _BS, _BE, _AMT = -112, -120, -128, -136, -144, -152
_QEMU, _NSINFO, _SLOT = -160, -168, -172  # the qemus key; bpf_pidns_info (pid, tgid); the pidns key
# The thread value: ino, last_index, index, readahead ino (u64); dev, readahead dev (u32).
_T_INO, _T_LAST, _T_INDEX, _T_RA_INO, _T_DEV, _T_RA_DEV = 0, 8, 16, 24, 32, 36


def programs(maps: Maps, points: dict[str, Tracepoint]) -> dict[str, bytes]:
    """The instructions of each event's program (by tracepoint name) for this kernel's record layouts.

    One program per event: a tracepoint program cannot read the record's
    common fields (the event type), so one program could not tell them apart.
    """
    get, add, sync, async_ = (points[name] for _, name in EVENTS)
    return {get.name: program(lambda a: _get_pages(a, maps, get), maps),
            add.name: program(lambda a: added(a, maps, add), maps),
            sync.name: program(lambda a: _readahead(a, maps, sync), maps),
            async_.name: program(lambda a: _readahead(a, maps, async_), maps)}


def program(body: Callable[[Asm], None], maps: Maps) -> bytes:
    """Only a registered QEMU's events go on to ``body``; every program returns 0 (no perf sample).

    A QEMU of the host's first pid namespace is found by the tgid ``bpf_get_current_pid_tgid`` gives
    (unique on the host); any other by its tgid in the namespace of the ``pidns`` table that the thread
    lives in (the helper answers only for that one). The thread id at _TID (the threads map's key) is the
    host's.
    """
    a = Asm()
    a.mov(6, ("r", 1))
    a.call(PID_TGID)
    a.store(10, _TID, 0, 4)
    a.alu("rsh", 0, 32)
    a.store(10, _QEMU, 0, 4)
    a.store_imm(10, _QEMU + 4, INIT_INO - (1 << 32), 4)
    lookup(a, maps.qemus, _QEMU)
    a.jump("ne", 0, 0, "qemu")
    a.store_imm(10, _SLOT, 0, 4)
    lookup(a, maps.pidns, _SLOT)
    a.jump("eq", 0, 0, "out")
    a.mov(7, ("r", 0))
    for i in range(SLOTS):  # filled from the front: the first empty pair ends it
        a.load(2, 7, i * 16 + 8, 8)
        a.jump("eq", 2, 0, "out")
        a.store(10, _QEMU + 4, 2, 4)
        a.load(1, 7, i * 16, 8)
        a.mov(3, ("r", 10))
        a.alu("add", 3, _NSINFO)
        a.mov(4, 8)
        a.call(NS_PID_TGID)
        a.jump("eq", 0, 0, "ns_found")  # else the thread lives in another namespace
    a.jump("ja", 0, 0, "out")
    a.label("ns_found")
    a.load(1, 10, _NSINFO + 4, 4)
    a.store(10, _QEMU, 1, 4)
    lookup(a, maps.qemus, _QEMU)
    a.jump("eq", 0, 0, "out")
    a.label("qemu")
    body(a)
    a.label("out")
    a.mov(0, 0)
    a.exit()
    return a.assemble()


def lookup(a: Asm, bpf_map: bpf.Map, key: int) -> None:
    """r0 = lookup(bpf_map, r10 + key)."""
    a.map_fd(1, bpf_map)
    a.mov(2, ("r", 10))
    a.alu("add", 2, key)
    a.call(LOOKUP)


#: Emits the loads of a file's identity from the program's context (r6) to the stack: i_ino (u64) at
#: ``r10 + slot``, s_dev (u32) at ``r10 + slot + 8``. Clobbers r1 and r2.
KeyLoader = Callable[[Asm, int], None]


def record_key(point: Tracepoint) -> KeyLoader:
    """The file of a page-cache tracepoint's record (its ``i_ino`` and ``s_dev`` fields)."""
    ino, dev = point.fields["i_ino"], point.fields["s_dev"]

    def emit(a: Asm, slot: int) -> None:
        a.load(1, 6, ino.offset, ino.size)
        a.store(10, slot, 1, 8)
        a.load(1, 6, dev.offset, 4)
        a.store(10, slot + 8, 1, 4)
    return emit


def watched(a: Asm, maps: Maps, key: KeyLoader) -> None:
    """The event's file as the key at _KEY; r8 = its meta value (out when it is not watched)."""
    key(a, _KEY)
    a.store_imm(10, _KEY + 12, 0, 4)
    lookup(a, maps.meta, _KEY)
    a.jump("eq", 0, 0, "out")
    a.mov(8, ("r", 0))


def _same_file(a: Asm, ino: int, dev: int, otherwise: str) -> None:
    """Go to ``otherwise`` unless the thread value at r0 names the key's file at ``ino``/``dev``."""
    a.load(1, 0, ino, 8)
    a.load(2, 10, _KEY, 8)
    a.jump("ne", 1, ("r", 2), otherwise)
    a.load(1, 0, dev, 4)
    a.load(2, 10, _KEY + 8, 4)
    a.jump("ne", 1, ("r", 2), otherwise)


def _thread(a: Asm, base: int, off: int, values: dict[int, tuple[int, int]]) -> None:
    """Write the thread value fields ``{offset: (stack slot or 0 for zero, size)}`` at ``base + off``."""
    for field, (slot, size) in values.items():
        if slot:
            a.load(1, 10, slot, size)
            a.store(base, off + field, 1, size)
        else:
            a.store_imm(base, off + field, 0, size)


def _get_pages(a: Asm, maps: Maps, point: Tracepoint) -> None:
    watched(a, maps, record_key(point))
    a.load(1, 6, point.fields["index"].offset, 8)
    a.store(10, _S, 1, 8)
    a.load(1, 6, point.fields["last_index"].offset, 8)
    a.store(10, _E, 1, 8)
    lookup(a, maps.threads, _TID)
    a.jump("eq", 0, 0, "gp_new_thread")
    _same_file(a, _T_INO, _T_DEV, "gp_new")
    a.load(1, 0, _T_LAST, 8)
    a.load(2, 10, _E, 8)
    a.jump("ne", 1, ("r", 2), "gp_new")
    a.load(1, 0, _T_INDEX, 8)
    a.load(2, 10, _S, 8)
    a.jump("ge", 1, ("r", 2), "gp_new")
    a.store(0, _T_INDEX, 2, 8)  # the same read going on: counted at its first batch
    a.store_imm(0, _T_RA_INO, 0, 8)
    a.jump("ja", 0, 0, "out")
    new = {_T_INO: (_KEY, 8), _T_LAST: (_E, 8), _T_INDEX: (_S, 8), _T_RA_INO: (0, 8), _T_DEV: (_KEY + 8, 4),
           _T_RA_DEV: (0, 4)}
    a.label("gp_new")
    _thread(a, 0, 0, new)
    a.jump("ja", 0, 0, "gp_count")
    a.label("gp_new_thread")
    _thread(a, 10, _TV, new)
    _update_thread(a, maps)
    a.label("gp_count")
    count_span(a, maps, 0, 8, "gp")


def _update_thread(a: Asm, maps: Maps) -> None:
    a.map_fd(1, maps.threads)
    a.mov(2, ("r", 10))
    a.alu("add", 2, _TID)
    a.mov(3, ("r", 10))
    a.alu("add", 3, _TV)
    a.mov(4, 0)
    a.call(UPDATE)


def _readahead(a: Asm, maps: Maps, point: Tracepoint) -> None:
    watched(a, maps, record_key(point))
    mark_reading(a, maps, "ra")


def mark_reading(a: Asm, maps: Maps, p: str) -> None:
    """Mark the thread as reading the file of the key at _KEY (pages entering the cache now are its misses);
    then out."""
    lookup(a, maps.threads, _TID)
    a.jump("eq", 0, 0, f"{p}_new")
    _thread(a, 0, 0, {_T_RA_INO: (_KEY, 8), _T_RA_DEV: (_KEY + 8, 4)})
    a.jump("ja", 0, 0, "out")
    a.label(f"{p}_new")
    _thread(a, 10, _TV, {_T_INO: (0, 8), _T_LAST: (0, 8), _T_INDEX: (0, 8), _T_RA_INO: (_KEY, 8),
                         _T_DEV: (0, 4), _T_RA_DEV: (_KEY + 8, 4)})
    _update_thread(a, maps)
    a.jump("ja", 0, 0, "out")


def unmark_reading(a: Asm, maps: Maps) -> None:
    """End the thread's mark (its read is over: pages entering the cache now are not its misses)."""
    lookup(a, maps.threads, _TID)
    a.jump("eq", 0, 0, "unmarked")
    a.store_imm(0, _T_RA_INO, 0, 8)
    a.store_imm(0, _T_RA_DEV, 0, 4)
    a.label("unmarked")


def added(a: Asm, maps: Maps, point: Tracepoint) -> None:
    """``mm_filemap_add_to_page_cache``: the folio's pages are the marked thread's misses (``order``
    appeared in 5.17: before, one page each)."""
    watched(a, maps, record_key(point))
    lookup(a, maps.threads, _TID)
    a.jump("eq", 0, 0, "out")
    _same_file(a, _T_RA_INO, _T_RA_DEV, "out")  # not in a read's readahead: a write's page
    a.load(1, 6, point.fields["index"].offset, 8)
    a.store(10, _S, 1, 8)
    order = point.fields.get("order")
    if order is not None:
        a.load(2, 6, order.offset, order.size)
        a.mov(3, 1)
        a.alu("lsh", 3, ("r", 2))
        a.alu("add", 3, ("r", 1))
        a.alu("sub", 3, 1)
        a.store(10, _E, 3, 8)
    else:
        a.store(10, _E, 1, 8)
    count_span(a, maps, 16, 24, "add")


def count_read(a: Asm, maps: Maps, first: int, last: int, p: str) -> None:
    """Count the read of pages r{first}..r{last} of the file (r8: its meta) as read; then out."""
    a.store(10, _S, first, 8)
    a.store(10, _E, last, 8)
    count_span(a, maps, 0, 8, p)


def count_span(a: Asm, maps: Maps, field: int, diff: int, p: str) -> None:
    """Count pages _S.._E of the file (r8: its meta) into its current count map; then out."""
    a.load(1, 8, 8, 4)  # the current generation
    a.store(10, _KEY + 12, 1, 4)
    lookup(a, maps.files, _KEY)
    a.jump("eq", 0, 0, "out")
    a.mov(9, ("r", 0))
    a.load(1, 8, 0, 8)  # pages per block
    a.jump("eq", 1, 0, "out")
    a.store(10, _PPB, 1, 8)
    a.load(2, 10, _S, 8)
    a.alu("div", 2, ("r", 1))
    a.store(10, _BS, 2, 8)
    a.load(3, 10, _E, 8)
    a.alu("div", 3, ("r", 1))
    a.store(10, _BE, 3, 8)
    a.jump("ne", 2, ("r", 3), f"{p}_multi")
    a.load(4, 10, _E, 8)  # within one block: e - s + 1
    a.load(5, 10, _S, 8)
    a.alu("sub", 4, ("r", 5))
    a.alu("add", 4, 1)
    _add(a, maps, _BS, 0, 4, field, f"{p}_one")
    a.jump("ja", 0, 0, "out")
    a.label(f"{p}_multi")
    a.load(4, 10, _BS, 8)  # the first block's part: (bs + 1) * ppb - s
    a.alu("add", 4, 1)
    a.load(1, 10, _PPB, 8)
    a.alu("mul", 4, ("r", 1))
    a.load(5, 10, _S, 8)
    a.alu("sub", 4, ("r", 5))
    _add(a, maps, _BS, 0, 4, field, f"{p}_first")
    a.load(4, 10, _BE, 8)  # the last block's part: e - be * ppb + 1
    a.load(1, 10, _PPB, 8)
    a.alu("mul", 4, ("r", 1))
    a.load(5, 10, _E, 8)
    a.alu("sub", 5, ("r", 4))
    a.alu("add", 5, 1)
    a.mov(4, ("r", 5))
    _add(a, maps, _BE, 0, 4, field, f"{p}_last")
    a.load(1, 10, _BS, 8)  # whole blocks between: +ppb from bs + 1, -ppb from be
    a.alu("add", 1, 1)
    a.load(2, 10, _BE, 8)
    a.jump("ge", 1, ("r", 2), "out")
    a.load(4, 10, _PPB, 8)
    _add(a, maps, _BS, 1, 4, diff, f"{p}_up")
    a.load(4, 10, _PPB, 8)
    a.alu("mul", 4, -1)
    _add(a, maps, _BE, 0, 4, diff, f"{p}_down")
    a.jump("ja", 0, 0, "out")


def _add(a: Asm, maps: Maps, block: int, plus: int, amount: int, field: int, p: str) -> None:
    """count[block slot + plus].field += r{amount}, in the count map r9 (a full map counts a drop)."""
    a.store(10, _AMT, amount, 8)
    a.load(1, 10, block, 8)
    if plus:
        a.alu("add", 1, plus)
    a.store(10, _BLOCK, 1, 8)
    a.mov(1, ("r", 9))
    a.mov(2, ("r", 10))
    a.alu("add", 2, _BLOCK)
    a.call(LOOKUP)
    a.jump("ne", 0, 0, f"{p}_have")
    for off in range(0, 32, 8):
        a.store_imm(10, _CV + off, 0, 8)
    a.mov(1, ("r", 9))
    a.mov(2, ("r", 10))
    a.alu("add", 2, _BLOCK)
    a.mov(3, ("r", 10))
    a.alu("add", 3, _CV)
    a.mov(4, NOEXIST)
    a.call(UPDATE)
    a.mov(1, ("r", 9))
    a.mov(2, ("r", 10))
    a.alu("add", 2, _BLOCK)
    a.call(LOOKUP)
    a.jump("ne", 0, 0, f"{p}_have")
    a.store_imm(10, _KEY + 12, 0, 4)  # the map is full: one drop for the file
    lookup(a, maps.drops, _KEY)
    a.jump("eq", 0, 0, f"{p}_done")
    a.mov(1, 1)
    a.atomic_add(0, 0, 1)
    a.load(1, 8, 8, 4)  # the generation again, for the next _add's key
    a.store(10, _KEY + 12, 1, 4)
    a.jump("ja", 0, 0, f"{p}_done")
    a.label(f"{p}_have")
    a.load(1, 10, _AMT, 8)
    a.atomic_add(0, field, 1)
    a.label(f"{p}_done")

