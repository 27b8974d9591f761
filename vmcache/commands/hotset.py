"""``vmcache hotset DOMAIN [--json] [--clear]``: the hot set saved in a domain's XML.

Shows, per disk, the image the set was saved for and the regions it holds
(with ``--json``: every region, highest priority first), or removes it
(``--clear``): the domain's next start is then a cold one. A running agent
saves a new set at its next save (``hotset_interval``); ``vmcache disable``
stops that.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from ..host.virtdomain import Affect, VirtDomain, connect
from ..settings.hotset import HotSet
from ..units import format_size
from .enable import add_affect_options, affect, read_from

NAME = "hotset"
HELP = "show (or --clear) the hot set an agent saved in a domain's XML for its warm start"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("domain", help="libvirt domain name")
    parser.add_argument("--json", action="store_true", help="print the set as JSON, every region")
    parser.add_argument("--clear", action="store_true",
                        help="remove it (default: from the live definition if running and the persistent one)")
    add_affect_options(parser)
    parser.add_argument("--uri", default="qemu:///system", help="libvirt URI (default qemu:///system)")


def to_json(hotset: HotSet) -> dict[str, Any]:
    """The set as JSON: disks with their image identity and regions ``[start, length, heat per block]``."""
    return {"saved": hotset.saved, "disks": [
        {"dev": d.dev, "image": d.image, "size": d.size, "image_id": d.image_id, "block_size": d.block_size,
         "bytes": d.bytes, "regions": [[r.start, r.length, round(d.mean_heat(r), 4)] for r in d.regions]}
        for d in hotset.disks]}


def _clear_flags(args: argparse.Namespace, dom: VirtDomain, active: bool) -> Affect:
    flags = affect(args)
    if flags != Affect.CURRENT:
        return flags
    flags = Affect.LIVE if active else Affect(0)
    return flags | Affect.CONFIG if dom.is_persistent() else flags


def run(args: argparse.Namespace) -> int:
    dom = VirtDomain(connect(args.uri), args.domain)
    active = dom.is_active()
    if args.clear:
        flags = _clear_flags(args, dom, active)
        dom.set_hotset(None, flags)
        print(f"{args.domain}: saved hot set removed")
        return 0
    hotset = dom.hotset(read_from(affect(args), active))
    if args.json:
        print(json.dumps(None if hotset is None else to_json(hotset), indent=1))
        return 0
    if hotset is None:
        print(f"{args.domain}: no saved hot set")
        return 0
    age = max(0, int(time.time()) - hotset.saved)
    print(f"{args.domain}: hot set saved {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(hotset.saved))}"
          f" ({age}s ago), {len(hotset.disks)} disk(s)")
    for d in hotset.disks:
        print(f"  {d.dev}: {len(d.regions)} regions, {format_size(d.bytes)} of {d.image} "
              f"({format_size(d.size)}, id {d.image_id or 'none'}), blocks {format_size(d.block_size)}")
    return 0
