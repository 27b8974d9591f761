"""``vmcache hotset DOMAIN [--json] [--clear]``: the hot set saved for a domain's warm start, and where it is.

An agent saves the set into the domain's XML (live and persistent
definition) and into the host's copy, ``<hotset_dir>/<uuid>.xml``; the
next agent warms from the newest valid one. This shows that one - saying
where it came from - per disk the image it was saved for and the regions
it holds (with ``--json``: every region, highest priority first, and what
each place holds), or removes every copy (``--clear``): the domain's next
start is then a cold one. ``--live``/``--config`` show (or clear) that
definition's XML alone. A running agent saves a new set at its next save
(``hotset_interval``); ``vmcache disable`` stops that.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from ..errors import VmcacheError
from ..host.hotstore import HotStore
from ..host.virtdomain import Affect, VirtDomain, connect
from ..settings.config import HostConfig
from ..settings.hotset import PLACES, HotSet, newest
from ..units import format_size
from ._host import add_host_options, host_config
from .enable import add_affect_options, affect

NAME = "hotset"
HELP = "show (or --clear) the hot set saved for a domain's warm start, and where it is kept"

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("domain", help="libvirt domain name")
    parser.add_argument("--json", action="store_true", help="print the set as JSON, every region")
    parser.add_argument("--clear", action="store_true",
                        help="remove it (default: from both definitions and the host's copy)")
    add_affect_options(parser)
    add_host_options(parser)


def to_json(hotset: HotSet) -> dict[str, Any]:
    """The set as JSON: disks with their image identity and regions ``[start, length, heat per block]``."""
    return {"saved": hotset.saved, "disks": [
        {"dev": d.dev, "image": d.image, "size": d.size, "image_id": d.image_id, "block_size": d.block_size,
         "bytes": d.bytes, "regions": [[r.start, r.length, round(d.mean_heat(r), 4)] for r in d.regions]}
        for d in hotset.disks]}


def _store(config: HostConfig) -> HotStore | None:
    return None if config.hotset_dir is None else HotStore(config.hotset_dir)


def _places(dom: VirtDomain, store: HotStore | None, flags: Affect) -> list[tuple[str, str | None]]:
    """The places asked about: (where, the host copy's path or None)."""
    places: list[tuple[str, str | None]] = []
    if flags & Affect.LIVE or flags & Affect.CONFIG:
        places += [("live", None)] if flags & Affect.LIVE else []
        return places + ([("persistent", None)] if flags & Affect.CONFIG else [])
    places += [("live", None)] if dom.is_active() else []
    places += [("persistent", None)] if dom.is_persistent() else []
    return places + ([("host", store.path(dom.uuid()))] if store is not None else [])


def _read(dom: VirtDomain, store: HotStore | None, where: str) -> HotSet | None:
    if where == "host":
        assert store is not None
        return store.load(dom.uuid())
    return dom.hotset(Affect.LIVE if where == "live" else Affect.CONFIG)


def run(args: argparse.Namespace) -> int:
    store = _store(host_config(args))
    dom = VirtDomain(connect(args.uri), args.domain)
    places = _places(dom, store, affect(args))
    if args.clear:
        flags = Affect(0)
        for where, _ in places:
            flags |= {"live": Affect.LIVE, "persistent": Affect.CONFIG}.get(where, Affect(0))
        if flags:
            dom.set_hotset(None, flags)
        if store is not None and any(w == "host" for w, _ in places):
            store.remove(dom.uuid())
        print(f"{args.domain}: saved hot set removed from " + ", ".join(PLACES[w] for w, _ in places))
        return 0
    found: list[tuple[str, HotSet]] = []
    report: dict[str, Any] = {}
    for where, path in places:
        try:
            hotset = _read(dom, store, where)
        except VmcacheError as err:
            report[where] = {"error": str(err), "path": path}
            continue
        report[where] = {"saved": None if hotset is None else hotset.saved, "path": path}
        if hotset is not None:
            found.append((where, hotset))
    chosen = newest(found)
    if args.json:
        out = None if chosen is None else {**to_json(chosen[1]), "source": chosen[0]}
        print(json.dumps(None if out is None else {**out, "places": report}, indent=1))
        return 0
    for where, state in report.items():
        if "error" in state:
            print(f"{args.domain}: {PLACES[where]}: unusable: {state['error']}")
    if chosen is None:
        print(f"{args.domain}: no saved hot set")
        return 0
    where, hotset = chosen
    age = max(0, int(time.time()) - hotset.saved)
    path = report[where]["path"]
    print(f"{args.domain}: hot set from {PLACES[where]}" + (f" ({path})" if path else "")
          + f", saved {_when(hotset.saved)} ({age}s ago), {len(hotset.disks)} disk(s)")
    for d in hotset.disks:
        print(f"  {d.dev}: {len(d.regions)} regions, {format_size(d.bytes)} of {d.image} "
              f"({format_size(d.size)}, id {d.image_id or 'none'}), blocks {format_size(d.block_size)}")
    others = [f"{PLACES[w]} saved {_when(h.saved)}" + (" (same)" if h == hotset else " (older)")
              for w, h in found if w != where]
    if others:
        print("  also in: " + "; ".join(others))
    return 0


def _when(saved: int) -> str:
    """A save's time as the operator reads it (the host's local time)."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(saved))
