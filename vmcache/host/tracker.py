"""DirtyTracker: the exact guest writes of one disk, cycle by cycle.

A dirty bitmap on the disk's *storage* node records every write in
image-file offsets. Each ``read()``:

1. rotates in one ``transaction``: add a new (enabled) bitmap, disable the
   old one; the old one joins the *pending* list (writes not yet read);
2. compacts pending bitmaps left by earlier failed reads into the oldest
   one (``block-dirty-bitmap-merge`` + ``block-dirty-bitmap-remove``, one
   ``transaction``);
3. starts QEMU's NBD server on a unix socket in a 0700 runtime directory
   (or defers, when a server already runs: libvirt's backups use it),
   exports a read-only *view* node with the pending bitmaps, reads them
   with libnbd ``block_status``, deletes the export, stops the server;
4. removes the bitmaps it read.

Step 3 is vmcache.host.nbdexport's :class:`BitmapExport`: the view is a
``null-co`` node (QEMU 7.2 refuses to export a qcow2 image's storage node),
so the bitmaps are exported by ``{node, name}`` on a node of their own. It
reads nothing from the image.

When a read fails or is deferred the disabled bitmaps stay and are read on
a later cycle: no write is lost. Names carry ``prefix``; ``start()`` removes
stale ones of ours from the node, ``stop()`` removes all of ours.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any, Final

from ..errors import BitmapReadError, MonitorBusyError, QMPCommandError, TrackerError
from ..logfmt import event
from ..model.extents import BitmapRead, DirtyRead, empty_extents, granularity_for
from .blockdev import node_size
from .allocation import data_extents
from .nbdexport import BitmapExport, DataReader, Deferred, ExtentReader
from .nbdreader import read_dirty_extents
from .qmp import Monitor

__all__ = [
    "DEFAULT_GRANULARITY",
    "DEFAULT_PREFIX",
    "DirtyTracker",
    "ExtentReader",
]

DEFAULT_GRANULARITY: Final = 64 * 1024
DEFAULT_PREFIX: Final = "vmcache-"

_log = logging.getLogger(__name__)


class DirtyTracker:
    """Dirty-bitmap tracking of one storage node; see the module docstring.

    ``runtime_dir``: where the NBD socket goes (created 0700 if missing,
    refused if group/other can enter it); a private temporary directory
    when None. ``socket_owner`` (uid, gid): the user QEMU runs as, which
    must create the socket there - the directory is given to it (still
    0700; root connects anyway); None when QEMU runs as this process's
    user. ``reader`` reads the exported bitmaps (tests replay a recording);
    ``data`` finds where the image file holds data (only there is asked).
    Usable as a context manager (``start()`` / ``stop()``). Not
    thread-safe; trackers of one QEMU must not read at the same time (QEMU
    has one NBD server).
    """

    def __init__(
        self,
        monitor: Monitor,
        node_name: str,
        *,
        granularity: int = DEFAULT_GRANULARITY,
        runtime_dir: str | None = None,
        socket_owner: tuple[int, int] | None = None,
        prefix: str = DEFAULT_PREFIX,
        timeout: float = 10.0,
        logger: logging.Logger | None = None,
        reader: ExtentReader = read_dirty_extents,
        data: DataReader = data_extents,
    ) -> None:
        if granularity < 512 or granularity & (granularity - 1):
            raise TrackerError(f"granularity {granularity}: must be a power of two, at least 512")
        if not prefix:
            raise TrackerError("bitmap prefix must not be empty")
        self._monitor = monitor
        self.node_name = node_name
        self.granularity = granularity
        self.prefix = prefix
        self.timeout = timeout
        self._log = logger or _log
        self._export = BitmapExport(monitor, node_name, prefix=prefix, runtime_dir=runtime_dir,
                                    socket_owner=socket_owner, timeout=timeout, logger=self._log,
                                    granularity=granularity, reader=reader, data=data)
        self._session = secrets.token_hex(4)
        self._serial = 0
        self._active: str | None = None
        self._pending: list[str] = []
        self._read_done: list[str] = []

    # -- public -----------------------------------------------------------

    @property
    def monitor(self) -> Monitor:
        """QEMU's monitor; replaced when libvirtd reconnects (the NBD export follows)."""
        return self._monitor

    @monitor.setter
    def monitor(self, monitor: Monitor) -> None:
        self._monitor = monitor
        self._export.monitor = monitor

    @property
    def socket_path(self) -> str:
        """Where QEMU's NBD server listens while a read runs. Raises TrackerError before ``start``."""
        return self._export.socket_path

    @property
    def view_node(self) -> str:
        return self._export.view_node

    @property
    def export_name(self) -> str:
        return self._export.export_name

    @property
    def session(self) -> str:
        """The random tag in this tracker's bitmap names (``PREFIX + session + "-" + serial``)."""
        return self._session

    @property
    def active(self) -> str | None:
        """The bitmap recording now."""
        return self._active

    @property
    def pending(self) -> tuple[str, ...]:
        """Disabled bitmaps whose writes have not been read yet."""
        return tuple(self._pending)

    def start(self) -> None:
        """Remove stale bitmaps/exports/view of ours, add the first bitmap.

        Raises TrackerError (DiskNotFoundError when the node is not there),
        MonitorError.
        """
        if self._active is not None:
            return
        self._export.open_dir()
        nodes = self.monitor.execute("query-named-block-nodes", {"flat": True})
        size = node_size(nodes, self.node_name)  # DiskNotFoundError when absent
        self.granularity = self._export.granularity = granularity_for(size, self.granularity)
        self._remove_stale(nodes)
        name = self._next_name()
        self.monitor.execute(
            "block-dirty-bitmap-add",
            {"node": self.node_name, "name": name, "granularity": self.granularity, "persistent": False},
        )
        self._active = name
        self._log.info(event("tracker.start", node=self.node_name, bitmap=name, granularity=self.granularity))

    def read(self) -> DirtyRead:
        """Writes since the previous read (or since start).

        Returns a DEFERRED result when QEMU's NBD server is busy (not ours).
        Raises BitmapReadError when the bitmaps could not be read (they are
        kept for the next read), TrackerError, MonitorError.
        """
        if self._active is None:
            raise TrackerError("tracker not started")
        try:
            self._retry_removals()
            try:
                self._rotate()
            except QMPCommandError as err:
                if not _is_missing_bitmap(err):
                    raise
                self._replace_lost(err)
            self._compact()
            nodes = self.monitor.execute("query-named-block-nodes", {"flat": True})
            extents = self._export.read(self._pending, nodes) if self._dirty(nodes) else empty_extents()
        except (Deferred, MonitorBusyError) as why:  # the rotated bitmaps stay pending: no write is lost
            self._log.info(event("tracker.deferred", node=self.node_name, pending=len(self._pending), reason=why))
            return DirtyRead(BitmapRead.DEFERRED, empty_extents(), str(why))
        read, self._pending = self._pending, []
        self._read_done.extend(read)
        self._retry_removals()
        result = DirtyRead(BitmapRead.OK, extents)
        self._log.debug(
            event("tracker.read", node=self.node_name, bitmaps=",".join(read), extents=len(extents), bytes=result.bytes)
        )
        return result

    def stop(self) -> None:
        """Remove every bitmap, export and view of ours; stop our NBD server.

        Best effort: what QEMU refuses is logged. Raises MonitorError only
        when the monitor itself fails (local state is cleared anyway).
        """
        try:
            self._export.drop()
            nodes = self.monitor.execute("query-named-block-nodes", {"flat": True})
            names = self._our_bitmaps(nodes) + self._pending + self._read_done
            names = list(dict.fromkeys(names + ([self._active] if self._active else [])))
            self._remove_bitmaps(names, missing_ok=True)
            self._log.info(event("tracker.stop", node=self.node_name, removed=len(names)))
        finally:
            self._active = None
            self._pending = []
            self._read_done = []
            self._export.close_dir()

    def __enter__(self) -> DirtyTracker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- steps ------------------------------------------------------------

    def _next_name(self) -> str:
        self._serial += 1
        return f"{self.prefix}{self._session}-{self._serial}"

    def _rotate(self) -> None:
        old, new = self._active, self._next_name()
        try:
            self.monitor.execute(
                "transaction",
                {
                    "actions": [
                        {
                            "type": "block-dirty-bitmap-add",
                            "data": {
                                "node": self.node_name,
                                "name": new,
                                "granularity": self.granularity,
                                "persistent": False,
                            },
                        },
                        {"type": "block-dirty-bitmap-disable", "data": {"node": self.node_name, "name": old}},
                    ]
                },
            )
        except MonitorBusyError:
            self._serial -= 1  # not sent: the name is free (one sent and lost might exist in QEMU: never reused)
            raise
        self._active = new
        assert old is not None
        self._pending.append(old)

    def _replace_lost(self, err: QMPCommandError) -> None:
        """Our recording bitmap was removed by someone else: record again from now, say what was lost.

        Without this every later rotation fails on the missing name and the
        disk's writes go unseen for the rest of the run. Only our own bitmap
        is added back; nothing else of ours is swept (the remover may be a
        second agent whose bitmaps are alive). Raises BitmapReadError.
        """
        lost = self._active
        nodes = self.monitor.execute("query-named-block-nodes", {"flat": True})
        present = set(self._our_bitmaps(nodes))
        self._pending = [name for name in self._pending if name in present]
        self._read_done = [name for name in self._read_done if name in present]
        name = self._next_name()
        self.monitor.execute(
            "block-dirty-bitmap-add",
            {"node": self.node_name, "name": name, "granularity": self.granularity, "persistent": False},
        )
        self._active = name
        self._log.warning(event("tracker.bitmap_lost", node=self.node_name, bitmap=lost, new=name, error=err))
        raise BitmapReadError(
            f"dirty bitmap {lost} was removed by someone else: its writes are unknown, recording again as {name}"
        ) from err

    def _compact(self) -> None:
        """Merge pending bitmaps into the oldest one, so a long deferral keeps one bitmap."""
        if len(self._pending) < 2:
            return
        target, rest = self._pending[0], self._pending[1:]
        actions: list[dict[str, Any]] = [
            {
                "type": "block-dirty-bitmap-merge",
                "data": {"node": self.node_name, "target": target, "bitmaps": rest},
            }
        ]
        actions += [
            {"type": "block-dirty-bitmap-remove", "data": {"node": self.node_name, "name": name}} for name in rest
        ]
        try:
            self.monitor.execute("transaction", {"actions": actions})
        except QMPCommandError as err:
            # Nothing changed (a transaction is atomic): read them all later.
            self._log.warning(event("tracker.merge_failed", node=self.node_name, error=err))
            return
        self._pending = [target]

    # -- cleanup helpers --------------------------------------------------

    def _dirty(self, nodes: list[dict[str, Any]]) -> bool:
        """Whether a pending bitmap holds a write (QEMU's count; not listed: read it to find out).

        A clean period - most of an idle disk's - then costs this one query,
        not an NBD server, a view, a merge and an export.
        """
        for node in nodes:
            if node.get("node-name") == self.node_name:
                counts = {str(b.get("name", "")): int(b.get("count", 1)) for b in node.get("dirty-bitmaps") or ()}
                return any(counts.get(name, 1) for name in self._pending)
        return True

    def _our_bitmaps(self, nodes: list[dict[str, Any]]) -> list[str]:
        for node in nodes:
            if node.get("node-name") == self.node_name:
                return [
                    name for b in node.get("dirty-bitmaps") or ()
                    if (name := str(b.get("name", ""))).startswith(self.prefix)  # a job's bitmap has none
                ]
        return []

    def _remove_bitmaps(self, names: list[str], *, missing_ok: bool) -> list[str]:
        """Remove ``names``; return those that could not be removed."""
        failed = []
        for name in names:
            try:
                self.monitor.execute("block-dirty-bitmap-remove", {"node": self.node_name, "name": name})
            except QMPCommandError as err:
                if missing_ok and "not found" in err.desc:
                    continue
                self._log.warning(event("tracker.remove_failed", node=self.node_name, bitmap=name, error=err))
                failed.append(name)
        return failed

    def _retry_removals(self) -> None:
        """Remove the bitmaps already read; one held back by a libvirt job (a block resize, a snapshot) waits
        for the next read: the writes it held were read, and must not be lost with its removal."""
        if self._read_done:
            try:
                self._read_done = self._remove_bitmaps(self._read_done, missing_ok=True)
            except MonitorBusyError:  # not sent; those removed before it go again as "not found"
                pass

    def _remove_stale(self, nodes: list[dict[str, Any]]) -> None:
        """A crashed agent may have left bitmaps, an export, a view node and its NBD server."""
        self._export.remove_stale(nodes)
        stale = self._our_bitmaps(nodes)
        if stale:
            self._log.info(event("tracker.stale_bitmaps", node=self.node_name, bitmaps=",".join(stale)))
            self._remove_bitmaps(stale, missing_ok=True)


def _is_missing_bitmap(err: QMPCommandError) -> bool:
    """QEMU's answer when a bitmap named in a command does not exist (``Dirty bitmap 'X' not found``)."""
    return err.error_class == "GenericError" and "not found" in err.desc and "itmap" in err.desc
