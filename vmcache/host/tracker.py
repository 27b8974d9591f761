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

The view is a ``null-co`` node: QEMU 7.2 refuses to export a qcow2
image's storage node (an NBD export unshares ``resize``, which qcow2 needs),
so the bitmaps are exported by ``{node, name}`` on a node of their own. It
reads nothing from the image.

When a read fails or is deferred the disabled bitmaps stay and are read on
a later cycle: no write is lost. Names carry ``prefix``; ``start()`` removes
stale ones of ours from the node, ``stop()`` removes all of ours.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import shutil
import socket
import stat
import tempfile
from typing import Any, Final, Protocol

import numpy as np

from ..errors import BitmapReadError, QMPCommandError, TrackerError
from ..logfmt import event
from ..model.extents import BitmapRead, DirtyRead, empty_extents
from .blockdev import node_size
from .nbdreader import read_dirty_extents
from .qmp import Monitor

__all__ = [
    "DEFAULT_GRANULARITY",
    "DEFAULT_PREFIX",
    "VIEW_SIZE",
    "DirtyTracker",
    "ExtentReader",
]

DEFAULT_GRANULARITY: Final = 64 * 1024
DEFAULT_PREFIX: Final = "vmcache-"
#: Size of the null-co view node: larger than any image (bitmaps end before it).
VIEW_SIZE: Final = 1 << 62
#: QEMU's answer to nbd-server-start while a server runs (ours or libvirt's).
NBD_ALREADY_RUNNING: Final = "NBD server already running"
NBD_NOT_RUNNING: Final = "NBD server not running"
_MAX_NODE_NAME: Final = 31

_log = logging.getLogger(__name__)


class ExtentReader(Protocol):
    """Reads the union of bitmaps from an NBD export (``nbdreader.read_dirty_extents``)."""

    def __call__(
        self, socket_path: str, export: str, bitmaps: list[str], length: int, *, timeout: float
    ) -> np.ndarray: ...


class _Deferred(Exception):
    pass


def _short_id(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:8]


class DirtyTracker:
    """Dirty-bitmap tracking of one storage node; see the module docstring.

    ``runtime_dir``: where the NBD socket goes (created 0700 if missing,
    refused if group/other can enter it); a private temporary directory
    when None. ``socket_owner`` (uid, gid): the user QEMU runs as, which
    must create the socket there - the directory is given to it (still
    0700; root connects anyway); None when QEMU runs as this process's
    user. ``reader`` reads the exported bitmaps (tests replay a recording).
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
    ) -> None:
        if granularity < 512 or granularity & (granularity - 1):
            raise TrackerError(f"granularity {granularity}: must be a power of two, at least 512")
        if not prefix:
            raise TrackerError("bitmap prefix must not be empty")
        self.monitor = monitor
        self.node_name = node_name
        self.granularity = granularity
        self.prefix = prefix
        self.timeout = timeout
        self._log = logger or _log
        self._reader = reader
        tag = _short_id(f"{prefix}\0{node_name}")
        self.view_node = f"{prefix}v{tag}"[:_MAX_NODE_NAME]
        self.export_name = f"{prefix}x{tag}"
        self._runtime_dir_arg = runtime_dir
        self._socket_owner = socket_owner
        self._runtime_dir: str | None = None
        self._made_runtime_dir = False
        self._session = secrets.token_hex(4)
        self._serial = 0
        self._active: str | None = None
        self._pending: list[str] = []
        self._read_done: list[str] = []
        self._server_ours = False
        self._view_ours = False

    # -- public -----------------------------------------------------------

    @property
    def socket_path(self) -> str:
        if self._runtime_dir is None:
            raise TrackerError("tracker not started")
        return os.path.join(self._runtime_dir, f"nbd-{_short_id(self.node_name)}.sock")

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
        self._open_runtime_dir()
        nodes = self.monitor.execute("query-named-block-nodes", {"flat": True})
        node_size(nodes, self.node_name)  # DiskNotFoundError when absent
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
        self._retry_removals()
        self._rotate()
        self._compact()
        try:
            extents = self._read_pending()
        except _Deferred as why:
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
            self._drop_export()
            self._stop_server()
            self._drop_view()
            nodes = self.monitor.execute("query-named-block-nodes", {"flat": True})
            names = self._our_bitmaps(nodes) + self._pending + self._read_done
            names = list(dict.fromkeys(names + ([self._active] if self._active else [])))
            self._remove_bitmaps(names, missing_ok=True)
            self._log.info(event("tracker.stop", node=self.node_name, removed=len(names)))
        finally:
            self._active = None
            self._pending = []
            self._read_done = []
            self._close_runtime_dir()

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
        self._active = new
        assert old is not None
        self._pending.append(old)

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

    def _read_pending(self) -> np.ndarray:
        if self._server_ours:
            self._stop_server()  # left running by a failed cleanup
        path = self.socket_path
        if os.path.exists(path):
            os.unlink(path)
        try:
            self.monitor.execute("nbd-server-start", {"addr": {"type": "unix", "data": {"path": path}}})
        except QMPCommandError as err:
            if NBD_ALREADY_RUNNING in err.desc:
                raise _Deferred(err.desc) from err
            raise BitmapReadError(f"{self.node_name}: cannot start NBD server: {err}") from err
        self._server_ours = True
        try:
            nodes = self.monitor.execute("query-named-block-nodes", {"flat": True})
            length = node_size(nodes, self.node_name)
            self._ensure_view(nodes)
            try:
                self.monitor.execute(
                    "block-export-add",
                    {
                        "type": "nbd",
                        "id": self.export_name,
                        "node-name": self.view_node,
                        "name": self.export_name,
                        "writable": False,
                        "bitmaps": [{"node": self.node_name, "name": name} for name in self._pending],
                    },
                )
            except QMPCommandError as err:
                raise BitmapReadError(f"{self.node_name}: cannot export bitmaps: {err}") from err
            try:
                return self._reader(path, self.export_name, list(self._pending), length, timeout=self.timeout)
            finally:
                self._drop_export()
        finally:
            self._stop_server()

    # -- cleanup helpers --------------------------------------------------

    def _ensure_view(self, nodes: list[dict[str, Any]]) -> None:
        if any(n.get("node-name") == self.view_node for n in nodes):
            return
        self.monitor.execute(
            "blockdev-add",
            {
                "driver": "null-co",
                "node-name": self.view_node,
                "size": VIEW_SIZE,
                "read-zeroes": True,
                "read-only": True,
            },
        )
        self._view_ours = True

    def _drop_view(self) -> None:
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

    def _our_bitmaps(self, nodes: list[dict[str, Any]]) -> list[str]:
        for node in nodes:
            if node.get("node-name") == self.node_name:
                return [
                    str(b["name"]) for b in node.get("dirty-bitmaps") or () if str(b["name"]).startswith(self.prefix)
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
        if self._read_done:
            self._read_done = self._remove_bitmaps(self._read_done, missing_ok=True)

    def _remove_stale(self, nodes: list[dict[str, Any]]) -> None:
        """A crashed agent may have left bitmaps, an export, a view node and its NBD server."""
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
            self._drop_view()
        stale = self._our_bitmaps(nodes)
        if stale:
            self._log.info(event("tracker.stale_bitmaps", node=self.node_name, bitmaps=",".join(stale)))
            self._remove_bitmaps(stale, missing_ok=True)

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

    def _open_runtime_dir(self) -> None:
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

    def _close_runtime_dir(self) -> None:
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
