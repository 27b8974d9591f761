"""Disk discovery over QMP: which block nodes hold which image files.

``query-named-block-nodes`` lists every node. An image file appears twice:
as its *storage* (protocol) node (driver ``file``, ``host_device``...) and
as the *format* node over it (``raw``, ``qcow2``...). A dirty bitmap on the
storage node reports image-file offsets (the page-cache space), so the
tracker works there. Only nodes with ``cache.direct == false`` use the host
page cache and are eligible. ``query-block`` adds the device's qdev path.

``parse_disks`` is pure (it takes the two replies); ``discover_disks``
asks the monitor.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from ..errors import DiskNotFoundError, QMPCommandError
from .qmp import Monitor

__all__ = ["PROTOCOL_DRIVERS", "BitmapInfo", "ImageDisk", "parse_disks", "discover_disks", "device_images",
           "device_chains", "backing_files", "chain_layers", "find_disk", "node_size"]

#: Drivers of storage (protocol) nodes that name a host file or device.
PROTOCOL_DRIVERS: Final = frozenset({"file", "host_device", "host_cdrom"})


@dataclass(frozen=True)
class BitmapInfo:
    """One dirty bitmap as ``query-named-block-nodes`` shows it (a block job's own has no name: "")."""

    name: str
    granularity: int
    count: int
    recording: bool
    busy: bool
    persistent: bool

    @classmethod
    def from_qmp(cls, raw: Mapping[str, Any]) -> BitmapInfo:
        return cls(
            name=str(raw.get("name", "")),
            granularity=int(raw["granularity"]),
            count=int(raw.get("count", 0)),
            recording=bool(raw.get("recording", False)),
            busy=bool(raw.get("busy", False)),
            persistent=bool(raw.get("persistent", False)),
        )


@dataclass(frozen=True)
class ImageDisk:
    """One image file as QEMU opened it.

    ``storage_node`` is the protocol node (bitmaps go there), ``size`` its
    length (the file's length), ``format_node``/``format`` the node over it
    (None when nothing is stacked on it), ``qdev`` the device path when a
    guest device uses it (``/machine/peripheral/ID/virtio-backend``).
    """

    filename: str
    storage_node: str
    protocol: str
    size: int
    direct: bool
    no_flush: bool
    format_node: str | None = None
    format: str | None = None
    qdev: str | None = None
    bitmaps: tuple[BitmapInfo, ...] = field(default_factory=tuple)
    backing: tuple[str, ...] = ()  # a device's top image only: the files of its backing chain, nearest first

    @property
    def eligible(self) -> bool:
        """True when the image goes through the host page cache (``cache.direct == false``)."""
        return not self.direct

    @property
    def device_id(self) -> str | None:
        """The ``-device id=`` (libvirt's alias, e.g. ``virtio-disk0``) when derivable from qdev."""
        if not self.qdev or not self.qdev.startswith("/machine/peripheral/"):
            return None
        return self.qdev[len("/machine/peripheral/") :].split("/", 1)[0] or None


def _cache(node: Mapping[str, Any]) -> tuple[bool, bool]:
    cache = node.get("cache") or {}
    return bool(cache.get("direct", False)), bool(cache.get("no-flush", False))


def parse_disks(nodes: Sequence[Mapping[str, Any]], block: Sequence[Mapping[str, Any]] = ()) -> list[ImageDisk]:
    """Image files from a ``query-named-block-nodes`` reply (and ``query-block`` for qdev).

    One ``ImageDisk`` per storage node, in QEMU's order. A format node is
    matched to the storage node with the same file name.
    """
    formats: dict[str, Mapping[str, Any]] = {}
    by_name: dict[str, Mapping[str, Any]] = {}
    for node in nodes:
        if node.get("drv") not in PROTOCOL_DRIVERS and node.get("file"):
            formats.setdefault(str(node["file"]), node)
            by_name[str(node.get("node-name"))] = node
    qdev_of, chain_of = {}, {}
    for dev in block:
        inserted = dev.get("inserted") or {}
        if inserted.get("node-name") and dev.get("qdev"):
            qdev_of[str(inserted["node-name"])] = str(dev["qdev"])
            chain_of[str(inserted["node-name"])] = backing_files(inserted)
    disks = []
    for node in nodes:
        if node.get("drv") not in PROTOCOL_DRIVERS:
            continue
        filename = str(node.get("file", ""))
        # Two disks on one file have a node pair each: pair libvirt's libvirt-N-format with
        # libvirt-N-storage, by file name only for other names.
        twin = by_name.get(str(node["node-name"]).removesuffix("-storage") + "-format")
        fmt = twin if twin is not None and twin.get("file") == node.get("file") else formats.get(filename)
        direct, no_flush = _cache(node)
        image = node.get("image") or {}
        fmt_name = str(fmt["node-name"]) if fmt else None
        disks.append(
            ImageDisk(
                filename=filename,
                storage_node=str(node["node-name"]),
                protocol=str(node["drv"]),
                size=int(image.get("virtual-size", 0)),
                direct=direct,
                no_flush=no_flush,
                format_node=fmt_name,
                format=str(fmt["drv"]) if fmt else None,
                qdev=qdev_of.get(fmt_name or "") or qdev_of.get(str(node["node-name"])),
                bitmaps=tuple(BitmapInfo.from_qmp(b) for b in node.get("dirty-bitmaps") or ()),
                backing=chain_of.get(fmt_name or "") or chain_of.get(str(node["node-name"]), ()),
            )
        )
    return disks


def backing_files(inserted: Mapping[str, Any]) -> tuple[str, ...]:
    """The files under a device's top image (``query-block``'s ``inserted``), nearest first.

    QEMU nests them as ``image.backing-image.backing-image...``; the
    ``filename`` of each is the file QEMU opened. A layer QEMU names by a
    ``json:`` description (no plain file under it) ends the chain.
    """
    files: list[str] = []
    image = (inserted.get("image") or {}).get("backing-image")
    while image:
        filename = str(image.get("filename", ""))
        if not filename or filename.startswith("json:"):
            break
        files.append(filename)
        image = image.get("backing-image")
    return tuple(files)


def chain_layers(disks: Sequence[ImageDisk], top: ImageDisk) -> list[ImageDisk]:
    """The backing layers of ``top`` as storage nodes (a file QEMU opened), nearest first.

    A file of the chain without a storage node of its own (a layer over a
    protocol vmcache does not read) is left out.
    """
    by_file: dict[str, ImageDisk] = {}
    for disk in disks:
        if disk.storage_node != top.storage_node:
            by_file.setdefault(os.path.realpath(disk.filename), disk)
    return [by_file[path] for path in map(os.path.realpath, top.backing) if path in by_file]


def discover_disks(monitor: Monitor) -> list[ImageDisk]:
    """Ask QEMU for its image files. Raises MonitorError."""
    nodes = monitor.execute("query-named-block-nodes", {"flat": True})
    try:
        block = monitor.execute("query-block")
    except QMPCommandError:  # a daemon without devices may not know it
        block = []
    return parse_disks(nodes, block)


def device_chains(monitor: Monitor) -> dict[str, tuple[str, ...]]:
    """Each guest device's top image and the files of its backing chain, as real paths. Raises MonitorError.

    One ``query-block``; a block pull or commit changes a chain under an unchanged top.
    """
    chains = {}
    for dev in monitor.execute("query-block") or ():
        inserted = dev.get("inserted") or {}
        if inserted.get("file"):
            chains[os.path.realpath(str(inserted["file"]))] = tuple(map(os.path.realpath, backing_files(inserted)))
    return chains


def device_images(monitor: Monitor) -> set[str]:
    """The image files guest devices use now (each device's top node), as real paths. Raises MonitorError.

    One ``query-block``: cheap enough for every cycle. An external snapshot,
    a block-job pivot or a media change replaces a device's image without a
    device event; this shows it.
    """
    images = set()
    for dev in monitor.execute("query-block") or ():
        filename = (dev.get("inserted") or {}).get("file")
        if filename:
            images.add(os.path.realpath(str(filename)))
    return images


def find_disk(disks: Iterable[ImageDisk], *, node: str | None = None, file: str | None = None) -> ImageDisk:
    """The disk whose storage or format node is ``node``, or whose image is ``file``.

    Raises DiskNotFoundError listing what exists.
    """
    disks = list(disks)
    for disk in disks:
        if node is not None and node in (disk.storage_node, disk.format_node):
            return disk
        if file is not None and (disk.filename == file or os.path.realpath(disk.filename) == os.path.realpath(file)):
            return disk
    wanted = node if node is not None else str(file)
    raise DiskNotFoundError(wanted, [f"{d.storage_node}={d.filename}" for d in disks])


def node_size(nodes: Sequence[Mapping[str, Any]], node_name: str) -> int:
    """Length in bytes of ``node_name`` in a ``query-named-block-nodes`` reply; DiskNotFoundError."""
    for node in nodes:
        if node.get("node-name") == node_name:
            return int((node.get("image") or {}).get("virtual-size", 0))
    raise DiskNotFoundError(node_name, [str(n.get("node-name")) for n in nodes])
