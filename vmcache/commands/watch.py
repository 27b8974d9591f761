"""``vmcache watch IMAGE --budget SIZE``: the paper's tool on one image file.

Loops: scan residency, update the heat, re-plan, pin; one status line per
cycle; releases everything on Ctrl-C / SIGTERM. Every model parameter is an
option (``--read-sigma 3``), validated like the YAML config.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from dataclasses import asdict, fields
from typing import Any

from ..errors import ConfigError
from ..model.params import ModelParams
from ..service.signalsafe import SignalSafeEvent
from ..units import format_size, number_or_text
from ._args import duration_arg, size_arg

NAME = "watch"
HELP = "pin the hot regions of one image file (standalone, no libvirt)"

DEFAULT_MIN_FREE = 512 << 20
DEFAULT_PREFETCH_RATE = 8 << 20


def _rate_arg(text: str) -> int | None:
    return None if text == "unlimited" else size_arg(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("image", help="image file to watch")
    parser.add_argument("--budget", type=size_arg, required=True, help="most bytes to pin, e.g. 512M, 2GiB")
    parser.add_argument("--interval", type=duration_arg, default=None,
                        help="cycle length (default: the model's interval, 10s)")
    parser.add_argument("--min-free", type=size_arg, default=DEFAULT_MIN_FREE,
                        help="never pin while host MemAvailable is under this (default 512MiB)")
    parser.add_argument("--prefetch-rate", type=_rate_arg, default=DEFAULT_PREFETCH_RATE, metavar="SIZE|unlimited",
                        help="most bytes per second read from the device to fill new pins (default 8MiB)")
    parser.add_argument("--count", type=int, default=0, help="stop after N cycles (default: run until Ctrl-C)")
    parser.add_argument("--json", action="store_true", help="one JSON object per cycle instead of a status line")
    parser.add_argument("--png", metavar="FILE", help="write a heat-map picture of the image every --png-every cycles")
    parser.add_argument("--png-every", type=int, default=1, metavar="N", help="cycles between pictures (default 1)")
    model = parser.add_argument_group("model parameters (see docs/configuration.md)")
    for f in fields(ModelParams):
        if f.name == "interval":
            continue
        model.add_argument("--" + f.name.replace("_", "-"), dest="model_" + f.name, default=None,
                           metavar="VALUE", help=f"default {f.default}")


def _params(args: argparse.Namespace) -> ModelParams:
    given: dict[str, Any] = {}
    for f in fields(ModelParams):
        raw = getattr(args, "model_" + f.name, None)
        if raw is not None:
            given[f.name] = number_or_text(raw) if f.name != "block_size" else raw
    if args.interval is not None:
        given["interval"] = args.interval
    try:
        return ModelParams.from_mapping(given)
    except ConfigError as err:
        raise ConfigError("--" + err.key.replace("_", "-"), err.value, err.reason) from None


def _line(cycle: int, stats: Any) -> str:
    mark = " BACKING-OFF" if stats.backing_off else ""
    return (f"cycle {cycle}: pinned {format_size(stats.pinned_bytes)}/{format_size(stats.budget_bytes)} "
            f"in {stats.pinned_regions} regions, resident {format_size(stats.resident_bytes)} "
            f"of {format_size(stats.size_bytes)}, guest read-miss {format_size(stats.guest_read_miss_bytes)}, "
            f"free {format_size(stats.mem_available_bytes)}, {stats.duration_seconds * 1000:.1f} ms{mark}")


def run(args: argparse.Namespace) -> int:
    from ..service.engine import DiskEngine  # numpy only once the arguments are good
    from ..service.enginepolicy import EnginePolicy

    params = _params(args)
    if args.png_every < 1:
        raise ConfigError("--png-every", args.png_every, "must be at least 1")
    stop = SignalSafeEvent()

    def on_signal(signum: int, _frame: object) -> None:
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with DiskEngine(args.image, params=params, budget=args.budget,
                        policy=EnginePolicy(args.min_free, prefetch_rate=args.prefetch_rate)) as engine:
            cycle = 0
            while not stop.is_set():
                started = time.monotonic()
                cycle += 1
                stats = engine.cycle()
                if args.json:
                    print(json.dumps({"cycle": cycle, **asdict(stats)}), flush=True)
                else:
                    print(_line(cycle, stats), flush=True)
                if args.png and cycle % args.png_every == 0:
                    _picture(engine, args.png)
                if args.count and cycle >= args.count:
                    break
                stop.wait(max(0.0, params.interval - (time.monotonic() - started)))
    finally:
        for signum, handler in old.items():
            signal.signal(signum, handler)
    print("released all pins", file=sys.stderr)
    return 0


def _picture(engine: Any, path: str) -> None:
    from ..host.files import write_atomic
    from ..observe.heatmap import render_png

    write_atomic(path, render_png(engine.heatmap_data(os.path.basename(engine.image), title="vmcache watch")))
