"""The NBD side of a dirty-bitmap read: QEMU's NBD server on our socket, a read-only view, one export.

QEMU 7.2 refuses to export a qcow2 image's storage node (an NBD export
unshares ``resize``, which qcow2 needs), so the bitmaps are read through a
``null-co`` *view* node of our own, which reads nothing from the image.
Nor may the storage node's own bitmaps be exported: an export makes them
*busy*, and a guest write that allocates a cluster at the end of a qcow2
file grows the storage node, which truncates every bitmap on it - QEMU
asserts that none is busy and aborts (the VM dies). So each read makes the
view the storage node's size, merges the bitmaps to read into one bitmap
*on the view* (a transaction) and exports that one: the view is in no write
path and is never resized. Should the file grow between the size query and
the merge, the sizes differ, QEMU refuses the merge and the read is tried
again. Only the ranges where the image file holds data
are asked (``asked_ranges``): the bitmaps are read after the rotation, whose
``transaction`` drained the node, so every write they hold has allocated its
bytes in the file by then. QEMU has one NBD server: when one runs that is not
ours (libvirt's backups use it), the read is deferred. The socket lives in
a 0700 runtime directory. :class:`~vmcache.host.tracker.DirtyTracker` owns
one :class:`BitmapExport` per storage node.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import stat
import tempfile
from typing import Any, Final, Protocol

import numpy as np

from ..errors import BitmapReadError, QMPCommandError, TrackerError
from ..logfmt import event
from ..model.extents import cover_extents
from .allocation import FileData, data_extents
from .blockdev import node_size
from .files import short_name
from .nbdreader import read_dirty_extents
from .qmp import Monitor

__all__ = [
    "MERGE_TRIES", "NBD_ALREADY_RUNNING", "NBD_NOT_RUNNING", "MAX_GAP", "MAX_RANGES", "BitmapExport", "DataReader",
    "Deferred", "ExtentReader", "asked_ranges",
]

#: Tries of a read's merge into the view when the image file grows between the size query and the merge.
MERGE_TRIES: Final = 3
#: QEMU's answer to nbd-server-start while a server runs (ours or libvirt's).
NBD_ALREADY_RUNNING: Final = "NBD server already running"
NBD_NOT_RUNNING: Final = "NBD server not running"
#: Data ranges of the image file closer than this are asked in one range (a clean gap costs QEMU little).
MAX_GAP: Final = 256 << 20
#: At most this many ranges a read (the smallest gaps are closed); each costs >= 1 block_status request.
MAX_RANGES: Final = 64
_MAX_NODE_NAME: Final = 31
#: Storage-node drivers whose ``file`` is a path that SEEK_DATA can walk.
_FILE_DRIVERS: Final = frozenset({"file"})


class ExtentReader(Protocol):
    """Reads the union of bitmaps from an NBD export (``nbdreader.read_dirty_extents``)."""

    def __call__(
        self, socket_path: str, export: str, bitmaps: list[str], length: int, *, timeout: float,
        ranges: np.ndarray | None = None,
    ) -> np.ndarray: ...


class DataReader(Protocol):
    """Data ranges of an image file, None when unknown (``allocation.data_extents``)."""

    def __call__(self, path: str) -> FileData | None: ...


def asked_ranges(data: FileData | None, length: int, granularity: int) -> np.ndarray | None:
    """The ranges of ``[0, length)`` a read asks about, from the file's data ranges (None: all).

    Past the file's size (smaller than QEMU's length) everything is asked.
    """
    if data is None:
        return None
    extents, size = data.extents, data.size
    if size < length:
        extents = np.concatenate((extents.reshape(-1, 2), np.array([[size, length - size]], dtype=np.int64)))
    return cover_extents(extents, granularity, length, max_gap=MAX_GAP, max_ranges=MAX_RANGES)


class Deferred(Exception):
    """QEMU's NBD server is busy with someone else's export: read later."""


class BitmapExport:
    """Reads bitmaps of ``node_name`` over NBD: server, view node and export, set up and torn down per read.

    ``runtime_dir``: where the socket goes (created 0700 if missing, refused
    if group/other can enter it); a private temporary directory when None.
    ``socket_owner`` (uid, gid): the user QEMU runs as, which must create the
    socket there - the directory is given to it (still 0700; root connects
    anyway); None when QEMU runs as this process's user.
    """

    def __init__(self, monitor: Monitor, node_name: str, *, prefix: str, runtime_dir: str | None,
                 socket_owner: tuple[int, int] | None = None, timeout: float, logger: logging.Logger,
                 granularity: int, reader: ExtentReader = read_dirty_extents,
                 data: DataReader = data_extents) -> None:
        self.monitor = monitor
        self.node_name = node_name
        self.granularity = granularity
        self._data = data
        self._identity: tuple[int, int] | None = None  # the image file the first walk found
        self._replaced = False  # the path has named another file since (told once)
        self.prefix = prefix
        self.timeout = timeout
        self._log = logger
        self._reader = reader
        tag = short_name(f"{prefix}\0{node_name}")
        self.view_node = f"{prefix}v{tag}"[:_MAX_NODE_NAME]
        self.export_name = f"{prefix}x{tag}"
        self.view_bitmap = f"{prefix}u{tag}"  # the union of a read's bitmaps, on the view
        self._runtime_dir_arg = runtime_dir
        self._socket_owner = socket_owner
        self._runtime_dir: str | None = None
        self._made_runtime_dir = False
        self._server_ours = False
        self._view_ours = False

    @property
    def socket_path(self) -> str:
        if self._runtime_dir is None:
            raise TrackerError("tracker not started")
        return os.path.join(self._runtime_dir, f"nbd-{short_name(self.node_name)}.sock")

    def read(self, bitmaps: list[str], nodes: list[dict[str, Any]] | None = None) -> np.ndarray:
        """The union of ``bitmaps`` as extents. Raises Deferred, BitmapReadError, MonitorError.

        ``nodes``: a ``query-named-block-nodes`` reply taken just before (saves asking again).
        """
        if self._server_ours:
            self._stop_server()  # left running by a failed cleanup
        path = self.socket_path
        if os.path.exists(path):
            os.unlink(path)
        try:
            self.monitor.execute("nbd-server-start", {"addr": {"type": "unix", "data": {"path": path}}})
        except QMPCommandError as err:
            if NBD_ALREADY_RUNNING in err.desc:
                raise Deferred(err.desc) from err
            raise BitmapReadError(f"{self.node_name}: cannot start NBD server: {err}") from err
        self._server_ours = True
        try:
            nodes, length = self._merge_into_view(bitmaps, nodes)
            try:
                self.monitor.execute(
                    "block-export-add",
                    {
                        "type": "nbd",
                        "id": self.export_name,
                        "node-name": self.view_node,
                        "name": self.export_name,
                        "writable": False,
                        "bitmaps": [self.view_bitmap],
                    },
                )
            except QMPCommandError as err:
                raise BitmapReadError(f"{self.node_name}: cannot export bitmaps: {err}") from err
            ranges = asked_ranges(self._file_data(nodes), length, self.granularity)
            try:
                return self._reader(path, self.export_name, [self.view_bitmap], length, timeout=self.timeout,
                                    ranges=ranges)
            finally:
                self._drop_export()
        finally:
            self._drop_view()
            self._stop_server()

    def _merge_into_view(self, bitmaps: list[str], nodes: list[dict[str, Any]] | None
                         ) -> tuple[list[dict[str, Any]], int]:
        """A view of the storage node's size holding the union of ``bitmaps``; the nodes and that size.

        Raises BitmapReadError when QEMU refuses it ``MERGE_TRIES`` times (the bitmaps stay for the next read).
        """
        for attempt in range(1, MERGE_TRIES + 1):
            if nodes is None or attempt > 1:
                nodes = self.monitor.execute("query-named-block-nodes", {"flat": True})
            length = node_size(nodes, self.node_name)
            if any(n.get("node-name") == self.view_node for n in nodes):
                self._drop_view(stale=True)  # left by a read that could not remove it
            self._add_view(-(-length // 512) * 512)  # QEMU sizes nodes in whole sectors, as the bitmaps
            try:
                self.monitor.execute("transaction", {"actions": [
                    {"type": "block-dirty-bitmap-add",
                     "data": {"node": self.view_node, "name": self.view_bitmap, "granularity": self.granularity,
                              "persistent": False}},
                    {"type": "block-dirty-bitmap-merge",
                     "data": {"node": self.view_node, "target": self.view_bitmap,
                              "bitmaps": [{"node": self.node_name, "name": name} for name in bitmaps]}},
                ]})
            except QMPCommandError as err:
                self._drop_view()
                if attempt == MERGE_TRIES:
                    raise BitmapReadError(f"{self.node_name}: cannot merge bitmaps for the read: {err}") from err
                self._log.info(event("tracker.merge_retry", node=self.node_name, error=err))
                continue
            return nodes, length
        raise AssertionError("unreachable")

    def remove_stale(self, nodes: list[dict[str, Any]]) -> None:
        """What a crashed agent may have left: our export, our NBD server, our view node."""
        exports = self.monitor.execute("query-block-exports")
        ours = [e for e in exports if e.get("id") == self.export_name]
        foreign = [e for e in exports if not str(e.get("id", "")).startswith(self.prefix)]
        if ours:
            self._drop_export()
        # Our export was on the server, or the server listens on our socket (an agent
        # killed between nbd-server-start and block-export-add): the server is ours.
        if (ours or self._server_on_our_socket()) and not foreign:
            self._server_ours = True
            self._stop_server()
        if any(n.get("node-name") == self.view_node for n in nodes):
            self._drop_view(stale=True)

    def drop(self) -> None:
        """Remove our export and view node, stop our server (best effort: refusals are logged)."""
        self._drop_export()
        self._stop_server()
        self._drop_view()

    def _file_data(self, nodes: list[dict[str, Any]]) -> FileData | None:
        """Data ranges of the storage node's file.

        None for a block device, anything not a plain path, or when the
        path names another file than it first did (the image replaced under
        QEMU, which still writes the old one).
        """
        for node in nodes:
            if node.get("node-name") == self.node_name and node.get("drv") in _FILE_DRIVERS:
                filename = str(node.get("file") or "")
                if not filename.startswith("/") or filename.startswith("/dev/fdset/"):
                    return None
                data = self._data(filename)
                if data is None:
                    return None
                if self._identity is None:
                    self._identity = data.identity
                if data.identity == self._identity:
                    return data
                if not self._replaced:
                    self._log.warning(event("tracker.image_replaced", node=self.node_name, file=filename))
                    self._replaced = True
                return None
        return None

    # -- QEMU objects -----------------------------------------------------

    def _add_view(self, size: int) -> None:
        self.monitor.execute(
            "blockdev-add",
            {"driver": "null-co", "node-name": self.view_node, "size": size, "read-zeroes": True, "read-only": True},
        )
        self._view_ours = True

    def _drop_view(self, *, stale: bool = False) -> None:
        """Delete the view (with its bitmap): ours, or ``stale`` - one a crashed or failed read left."""
        if not (self._view_ours or stale):
            return
        try:
            self.monitor.execute("blockdev-del", {"node-name": self.view_node})
        except QMPCommandError as err:
            if self._view_ours:
                self._log.warning(event("tracker.view_del_failed", node=self.view_node, error=err))
        self._view_ours = False

    def _drop_export(self) -> None:
        try:
            self.monitor.execute("block-export-del", {"id": self.export_name, "mode": "hard"})
        except QMPCommandError as err:
            if "not found" not in err.desc:
                self._log.warning(event("tracker.export_del_failed", export=self.export_name, error=err))

    def _stop_server(self) -> None:
        """Stop the NBD server if, and only if, we started it."""
        if not self._server_ours:
            return
        try:
            self.monitor.execute("nbd-server-stop")
        except QMPCommandError as err:
            if NBD_NOT_RUNNING not in err.desc:
                self._log.warning(event("tracker.nbd_stop_failed", node=self.node_name, error=err))
                return
        self._server_ours = False
        if self._runtime_dir is not None:
            try:
                os.unlink(self.socket_path)
            except FileNotFoundError:
                pass

    def _server_on_our_socket(self) -> bool:
        """True when something accepts connections on our socket path (QEMU's server, started by us)."""
        path = self.socket_path
        if not os.path.exists(path):
            return False
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(1.0)
            try:
                probe.connect(path)
            except OSError:
                return False
        return True

    # -- runtime directory ------------------------------------------------

    def open_dir(self) -> None:
        """Make (or check) the directory of the socket. Raises TrackerError."""
        if self._runtime_dir is not None:
            return
        if self._runtime_dir_arg is None:
            self._runtime_dir = tempfile.mkdtemp(prefix="vmcache-nbd-")
            self._made_runtime_dir = True
            return
        path = self._runtime_dir_arg
        owners = {os.geteuid()}
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
            if self._socket_owner is not None and self._socket_owner[0] != os.geteuid():
                # QEMU (e.g. libvirt-qemu on Debian) binds the socket in here.
                os.chown(path, *self._socket_owner)
                owners.add(self._socket_owner[0])
            info = os.lstat(path)
        except OSError as err:
            raise TrackerError(f"runtime directory {path}: {err.strerror}") from err
        if not stat.S_ISDIR(info.st_mode) or info.st_uid not in owners or info.st_mode & 0o077:
            raise TrackerError(f"runtime directory {path}: must be a directory of ours (or QEMU's) with mode 0700")
        self._runtime_dir = path

    def close_dir(self) -> None:
        """Remove our socket, and the directory when we made it."""
        if self._runtime_dir is None:
            return
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        if self._made_runtime_dir:
            shutil.rmtree(self._runtime_dir, ignore_errors=True)
        self._runtime_dir = None
        self._made_runtime_dir = False
