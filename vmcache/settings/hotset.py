"""The saved hot set: what vmcache held per disk, as a second metadata element (pure).

An agent saves the regions it holds for every managed disk in the domain's
own XML, so that libvirt carries them through a stop/start, a host reboot,
``virsh save``/``restore``, ``managedsave`` and a live migration; the next
agent warms the disk from them (docs/metadata.md, "The saved hot set")::

    <metadata>
      <vmcachehot:hotset xmlns:vmcachehot="urn:x-vmcache:hotset:1" version="2" saved="1795430400">
        <vmcachehot:disk dev="vda" image="/var/lib/libvirt/images/web-1.img" size="21474836480"
                         id="3f0c..." block="1048576" regions="412" bytes="1073741824">BASE64</vmcachehot:disk>
      </vmcachehot:hotset>
    </metadata>

It has a namespace of its own: libvirt keeps one metadata element per
namespace URI, so the agent can rewrite it without touching the
operator's ``<vmcache:cache>`` element (and its metadata-change event can
be told apart).

The regions of a disk are the text of its element: base64 of unsigned
LEB128 varints, four per region sorted by offset - blocks since the end of
the previous region, length in blocks, mean heat in 1/256, and the cycle
after the last start in which the guest first read the region (from 1; 0:
not read since), the order a warm start restores them in - about 5-6
bytes a region (1024 regions of a 1 TiB disk: ~7 KB of text). Version 1,
written before the order was kept, has three per region and is still
read: its regions are restored by heat. A record
keeps at most :data:`MAX_REGIONS` regions per disk, the highest priority
ones. ``image``, ``size`` and ``id`` (an identity kept with the image file,
vmcache.host.imageid) tie a record to the image it describes: a record
whose image does not match is ignored (:func:`mismatch`).

Anything not acceptable - too large, a version this code does not know,
a bad attribute, regions past the image - is one :class:`ConfigError`;
nothing else escapes :func:`parse_hotset` / :func:`hotset_of`.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Sequence
from dataclasses import dataclass
from xml.etree.ElementTree import Element, SubElement, tostring

from ..errors import ConfigError
from ..model.params import MAX_BLOCK_SIZE, PAGE_SIZE
from ..model.region import Region
from .metadata import known_attrs, parse_element, parse_xml

__all__ = [
    "HOTSET_NAMESPACE",
    "HOTSET_PREFIX",
    "HOTSET_ELEMENT",
    "VERSION",
    "READS",
    "MAX_REGIONS",
    "MAX_DISKS",
    "MAX_TEXT",
    "DiskHotSet",
    "HotSet",
    "build_hotset",
    "parse_hotset",
    "hotset_of",
    "mismatch",
    "newest",
    "PLACES",
    "top_regions",
]

HOTSET_NAMESPACE = "urn:x-vmcache:hotset:1"
"""Namespace URI of the saved hot set (virDomainSetMetadata ``uri``)."""
HOTSET_PREFIX = "vmcachehot"
"""Prefix libvirt writes the element with (virDomainSetMetadata ``key``)."""
HOTSET_ELEMENT = "hotset"
VERSION = 2
READS = (1, 2)
"""The versions :func:`parse_hotset` reads (1: no first-read order)."""
MAX_REGIONS = 1024
"""Most regions one disk's record keeps (the highest priority ones)."""
MAX_DISKS = 64
MAX_TEXT = 64 * 1024
"""Largest element, in characters, :func:`parse_hotset` reads (a full record of
:data:`MAX_DISKS` disks would not fit; a domain with a few disks is far under)."""

_NS = "{" + HOTSET_NAMESPACE + "}"
_HEAT_SCALE = 256
_MAX_HEAT_Q = 1 << 20
_MAX_CYCLE = 1 << 32
_DEV_RE = re.compile(r"^[A-Za-z0-9_-]{1,32}$")
_ID_RE = re.compile(r"^[0-9a-f]{8,64}$")
_MAX_PATH = 4096


@dataclass(frozen=True)
class DiskHotSet:
    """The regions held for one disk, and the image they belong to.

    ``regions``: byte ranges of the image file, highest priority first;
    ``priority`` is the region's heat summed over its blocks (as the planner
    counts it), so ``priority / blocks`` is its mean heat. ``first``: per
    region (the same index), the cycle after the last start in which the
    guest first read it, from 1 (0: not read since); empty where the
    record keeps no order (version 1, or none of its regions read since). ``image_id``: the identity kept with
    the image file (None where the file system keeps none).
    """

    dev: str
    image: str
    size: int
    image_id: str | None
    block_size: int
    regions: tuple[Region, ...]
    first: tuple[int, ...] = ()

    def order(self) -> dict[tuple[int, int], int]:
        """Each region's span and its first-read cycle (empty without an order)."""
        return {r.span: f for r, f in zip(self.regions, self.first)}

    @property
    def bytes(self) -> int:
        return sum(r.length for r in self.regions)

    def mean_heat(self, region: Region) -> float:
        """The region's heat per block."""
        return region.priority / max(1, -(-region.length // self.block_size))


@dataclass(frozen=True)
class HotSet:
    """A domain's saved hot set: ``saved`` (Unix seconds) and one record per disk."""

    saved: int
    disks: tuple[DiskHotSet, ...]

    def disk(self, dev: str) -> DiskHotSet | None:
        for record in self.disks:
            if record.dev == dev:
                return record
        return None


def mismatch(record: DiskHotSet, *, dev: str, image: str, size: int, image_id: str | None) -> str | None:
    """Why ``record`` does not describe this disk (None: it does).

    The disk's target dev and image path must be the same, and the image
    of the same size; when the record carries an identity the image must
    carry the same one (a replaced file has another or none).
    """
    if record.dev != dev:
        return f"saved for disk {record.dev}, not {dev}"
    if record.image != image:
        return f"saved for image {record.image}, the disk is now {image}"
    if record.size != size:
        return f"saved for an image of {record.size} bytes, it has {size} now"
    if record.image_id is not None and record.image_id != image_id:
        return f"saved for image id {record.image_id}, the image has {image_id or 'none'} (replaced?)"
    return None


PLACES = {"live": "the live definition", "persistent": "the persistent definition", "host": "the host's copy"}
"""Where a saved set may be read from (what :func:`newest` is given, the agent's status ``hotset_source``), in words."""


def newest(found: Sequence[tuple[str, HotSet]]) -> tuple[str, HotSet] | None:
    """The most recently saved of the sets ``found`` where each was read (the first of a tie); None for none.

    A domain's set may be in its live definition, its persistent one and
    the host's copy; the one saved last describes the guest best.
    """
    best: tuple[str, HotSet] | None = None
    for where, hotset in found:
        if best is None or hotset.saved > best[1].saved:
            best = (where, hotset)
    return best


# -- encoding -----------------------------------------------------------------------


def _varints(values: list[int]) -> bytes:
    out = bytearray()
    for value in values:
        while value >= 0x80:
            out.append((value & 0x7F) | 0x80)
            value >>= 7
        out.append(value)
    return bytes(out)


def _unvarints(data: bytes, what: str) -> list[int]:
    values: list[int] = []
    value = shift = 0
    for byte in data:
        value |= (byte & 0x7F) << shift
        if byte & 0x80:
            shift += 7
            if shift > 63:
                raise ConfigError(what, data[:20], "a number in the regions is too large")
        else:
            values.append(value)
            value = shift = 0
    if shift:
        raise ConfigError(what, data[-20:], "regions end in the middle of a number")
    return values


def _encode(record: DiskHotSet) -> str:
    bs = record.block_size
    values: list[int] = []
    end = 0
    firsts = record.first or (0,) * len(record.regions)
    for region, read in sorted(zip(record.regions, firsts), key=lambda pair: pair[0].start):
        first, blocks = region.start // bs, -(-region.length // bs)
        heat = record.mean_heat(region)
        values += (first - end, blocks, min(_MAX_HEAT_Q, max(0, round(heat * _HEAT_SCALE))), min(_MAX_CYCLE, read))
        end = first + blocks
    return base64.b64encode(_varints(values)).decode("ascii")


def _decode(text: str, *, block_size: int, size: int, what: str,
            per: int = 4) -> tuple[tuple[Region, ...], tuple[int, ...]]:
    try:
        data = base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError) as err:
        raise ConfigError(what, text[:40], f"regions are not base64: {err}") from None
    values = _unvarints(data, what)
    if len(values) % per:
        raise ConfigError(what, len(values), f"regions are not groups of {per} numbers")
    if len(values) // per > MAX_REGIONS:
        raise ConfigError(what, len(values) // per, f"more than {MAX_REGIONS} regions")
    file_end = -(-size // PAGE_SIZE) * PAGE_SIZE
    found: list[tuple[Region, int]] = []
    end = 0
    for i in range(0, len(values), per):
        gap, blocks, heat_q = values[i : i + 3]
        first = end + gap
        end = first + blocks
        start = first * block_size
        if blocks == 0 or start >= file_end:
            raise ConfigError(what, start, "a region is empty or starts past the end of the image")
        length = min(end * block_size, file_end) - start
        heat = heat_q / _HEAT_SCALE
        found.append((Region(start, length, heat * -(-length // block_size)), values[i + 3] if per > 3 else 0))
    found.sort(key=lambda pair: (-pair[0].priority, pair[0].start))
    cycles = tuple(f for _, f in found)
    return tuple(r for r, _ in found), (cycles if any(cycles) else ())  # none read since the start: no order


def top_regions(regions: list[Region] | tuple[Region, ...], limit: int = MAX_REGIONS) -> tuple[Region, ...]:
    """The ``limit`` highest-priority regions, highest first (what a record keeps)."""
    return tuple(sorted(regions, key=lambda r: (-r.priority, r.start))[:limit])


def _kept(record: DiskHotSet) -> DiskHotSet:
    """``record`` cut to its :data:`MAX_REGIONS` highest-priority regions, their first-read cycles with them."""
    order = record.order()
    regions = top_regions(record.regions)
    return DiskHotSet(record.dev, record.image, record.size, record.image_id, record.block_size, regions,
                      tuple(order.get(r.span, 0) for r in regions) if record.first else ())


def build_hotset(hotset: HotSet) -> str:
    """The element for virDomainSetMetadata(uri=HOTSET_NAMESPACE, key=HOTSET_PREFIX).

    Written without a namespace (libvirt adds it), :data:`VERSION` 2. A
    disk's regions are cut to the :data:`MAX_REGIONS` highest priority
    ones; ``parse_hotset`` of the result gives the same regions, heat
    rounded to 1/256, with their first-read cycles (0 where the record
    kept none). Raises
    ConfigError for more than :data:`MAX_DISKS` disks.
    """
    if len(hotset.disks) > MAX_DISKS:
        raise ConfigError("hotset disks", len(hotset.disks), f"more than {MAX_DISKS}")
    root = Element(HOTSET_ELEMENT, {"version": str(VERSION), "saved": str(int(hotset.saved))})
    for record in hotset.disks:
        kept = _kept(record)
        attrs = {"dev": kept.dev, "image": kept.image, "size": str(kept.size)}
        if kept.image_id is not None:
            attrs["id"] = kept.image_id
        attrs |= {"block": str(kept.block_size), "regions": str(len(kept.regions)), "bytes": str(kept.bytes)}
        SubElement(root, "disk", attrs).text = _encode(kept)
    return tostring(root, encoding="unicode")


# -- parsing ------------------------------------------------------------------------


def _int(element: Element, name: str, what: str, *, low: int = 0, high: int = 1 << 62) -> int:
    text = element.get(name)
    if text is None:
        raise ConfigError(f"{what} {name}", None, "missing")
    if not text.isdigit() or not low <= int(text) <= high:
        raise ConfigError(f"{what} {name}", text, f"must be a whole number in [{low}, {high}]")
    return int(text)


def _disk(element: Element, index: int, version: int) -> DiskHotSet:
    what = f"hotset disk[{index}]"
    known_attrs(element, ("dev", "image", "size", "id", "block", "regions", "bytes"), what)
    dev = element.get("dev") or ""
    if not _DEV_RE.match(dev):
        raise ConfigError(f"{what} dev", dev, "must be a target dev such as vda")
    image = element.get("image") or ""
    if not image.startswith("/") or len(image) > _MAX_PATH or "\0" in image:
        raise ConfigError(f"{what} image", image, "must be an absolute path")
    image_id = element.get("id")
    if image_id is not None and not _ID_RE.match(image_id):
        raise ConfigError(f"{what} id", image_id, "must be 8-64 lowercase hex digits")
    size = _int(element, "size", what, low=1)
    block = _int(element, "block", what, low=PAGE_SIZE, high=MAX_BLOCK_SIZE)
    if block % PAGE_SIZE:
        raise ConfigError(f"{what} block", block, f"must be a multiple of {PAGE_SIZE}")
    regions, first = _decode(element.text or "", block_size=block, size=size, what=f"{what} ({dev})",
                             per=3 if version == 1 else 4)
    return DiskHotSet(dev, image, size, image_id, block, regions, first)


def _parse(root: Element, ns: str) -> HotSet:
    known_attrs(root, ("version", "saved"), "hotset")
    version = root.get("version")
    if version not in [str(v) for v in READS]:
        raise ConfigError("hotset version", version,
                          f"not a version this vmcache reads ({', '.join(str(v) for v in READS)})")
    saved = _int(root, "saved", "hotset")
    disks: list[DiskHotSet] = []
    for child in root:
        if not isinstance(child.tag, str):  # comments, processing instructions
            continue
        if child.tag != ns + "disk":
            raise ConfigError("hotset", child.tag.replace(_NS, HOTSET_PREFIX + ":"), "unknown element (use disk)")
        if len(disks) == MAX_DISKS:
            raise ConfigError("hotset disks", len(disks) + 1, f"more than {MAX_DISKS}")
        disks.append(_disk(child, len(disks), int(version)))
    devs = [d.dev for d in disks]
    for dev in devs:
        if devs.count(dev) > 1:
            raise ConfigError("hotset disk dev", dev, "given twice")
    return HotSet(saved=saved, disks=tuple(disks))


def parse_hotset(xml: str | bytes) -> HotSet:
    """Parse the element alone, as virDomainGetMetadata returns it (no namespace) or with it.

    Raises ConfigError (one line) for anything not acceptable: more than
    :data:`MAX_TEXT` characters, malformed or hostile XML, an unknown
    version, attribute or element, regions that do not fit the image.
    """
    if len(xml) > MAX_TEXT:
        raise ConfigError("hotset", f"{len(xml)} characters", f"larger than {MAX_TEXT}")
    return _parse(*parse_element(xml, HOTSET_NAMESPACE, HOTSET_ELEMENT, "hotset"))


def hotset_of(domain_xml: str | bytes) -> HotSet | None:
    """The saved hot set in a full domain XML (``virsh dumpxml``); None when there is none.

    Raises ConfigError when the domain XML or the element is not acceptable
    (the element alone is held to :data:`MAX_TEXT` characters).
    """
    root = parse_xml(domain_xml, "domain XML")
    element = root.find("metadata/" + _NS + HOTSET_ELEMENT)
    if element is None:
        return None
    text = tostring(element, encoding="unicode")
    if len(text) > MAX_TEXT:
        raise ConfigError("hotset", f"{len(text)} characters", f"larger than {MAX_TEXT}")
    return _parse(element, _NS)
