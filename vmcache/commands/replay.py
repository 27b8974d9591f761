"""``vmcache replay TRACE``: device reads of vmcache, LRU, the kernel's lists and the optimum on a block trace.

Offline and deterministic: the trace (CSV ``time,op,offset,length`` or an
fio iolog) is replayed through simulated page caches of each ``--budget``;
the vmcache arms run the real cycle (heat model and planner) every
``--interval`` of trace time. ``vmcache replay --generate zoned|zipf|moving --out FILE``
writes a synthetic trace instead. ``vmcache replay --vm TRACE,budget=SIZE ...
--cap SIZE`` is the host mode: several VMs against one pinned cap, split
first-come, equally, by budget and by benefit (vmcache.replay.host). See
docs/replay.md.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from ..errors import ConfigError, HostError
from ..settings.config import HostConfig
from ..units import format_size, number_or_text, parse_duration, parse_size
from ._args import duration_arg, size_arg

NAME = "replay"
HELP = "replay a block trace: device reads of vmcache vs LRU, the kernel's lists and the optimum at equal memory"

DEFAULT_BLOCK = 64 << 10
DEFAULT_PIN_SHARE = 0.5
DEFAULT_FRACTIONS = (64, 16, 4)
"""Without --budget: the trace's footprint (the units it touches, whole MiB) divided by each of these."""
POLICY_CHOICES = ("vmcache", "inferred", "lru", "linux", "belady", "static", "warm", "warm-heat", "snapshot",
                  "most-read")
GENERATE_KINDS = ("zoned", "zipf", "moving", "stream")
VM_FORM = "TRACE,budget=SIZE[,min=SIZE][,name=N][,size=SIZE][,start=DURATION]"


def _rate(text: str) -> int | None:
    """``--prefetch-rate``: a size, or ``unlimited`` (None)."""
    return None if text == "unlimited" else size_arg(text)


def _budgets(text: str) -> list[int]:
    try:
        return [parse_size(part.strip(), key="--budget", allow_zero=False) for part in text.split(",") if part.strip()]
    except ConfigError as err:
        raise argparse.ArgumentTypeError(err.reason) from err


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", nargs="?", help="trace file: CSV (time,op,offset,length) or fio iolog v2/v3")
    parser.add_argument("--budget", type=_budgets, action="append", metavar="SIZE[,SIZE...]",
                        help="memory for every policy (repeat or comma-separate; default: the footprint - "
                             "the units the trace touches - / 64, 16, 4)")
    parser.add_argument("--block-size", type=size_arg, default=DEFAULT_BLOCK,
                        help="cache and model granularity, a multiple of 4096 (default 64KiB)")
    parser.add_argument("--cache-unit", type=size_arg, default=None, metavar="SIZE",
                        help="what the simulated caches hold, a divisor of --block-size (default: the block); "
                             "4KiB shows the model each block's resident share, as on a host")
    parser.add_argument("--interval", type=duration_arg, default=None,
                        help="vmcache re-plans every INTERVAL of trace time (default: the model's, 10s)")
    parser.add_argument("--pin-share", type=float, default=DEFAULT_PIN_SHARE,
                        help="share of each budget vmcache may pin; the rest is the --rest policy's (default 0.5)")
    parser.add_argument("--rest", choices=("linux", "lru"), default="linux",
                        help="what holds the memory vmcache does not pin: the kernel's lists (default) or LRU")
    parser.add_argument("--size", type=size_arg, default=None, help="image size (default: end of the trace)")
    parser.add_argument("--policy", action="append", choices=POLICY_CHOICES,
                        help="only these policies (repeat; default vmcache, inferred, lru, linux, belady; also "
                             "static, and warm: vmcache warm-started from the hot set a first run saved "
                             "(warm-heat: restored in heat order, not the order the guest first read it), "
                             "snapshot / most-read: from what the first run cached at its end / read most)")
    parser.add_argument("--head", type=duration_arg, default=None, metavar="DURATION",
                        help="also show the figures over the first DURATION of the trace (e.g. 60s)")
    parser.add_argument("--model", action="append", default=[], metavar="KEY=VALUE",
                        help="a model parameter, e.g. --model keep_factor=1.5 (see docs/configuration.md)")
    parser.add_argument("--prefetch-rate", type=_rate, default=None, metavar="SIZE",
                        help="bytes per trace second vmcache may load into regions it starts pinning, as the "
                             "agent's prefetch_rate (default: unlimited, loads are free)")
    parser.add_argument("--warm-rate", type=size_arg, default=None, metavar="SIZE",
                        help="the rate while a warm start restores its saved set, as the agent's warm_rate "
                             "(the higher of the two applies; default: --prefetch-rate)")
    parser.add_argument("--fill", choices=("whole", "cached"), default="whole",
                        help="as the agent's fill: new pins load their blocks' uncached pages (whole, the "
                             "default) or take only the pages cached (cached: nothing loaded)")
    parser.add_argument("--read-model", choices=("counted", "inferred"), default=None,
                        help="host mode (--vm): what the VMs' models decide on, as the agents' read_model: reads "
                             "counted exactly (the default, as the agents') or inferred from residency and read "
                             "evidence; a single trace has both as policies (vmcache, inferred)")
    parser.add_argument("--fio-file", metavar="NAME", help="fio iolog naming several files: replay this one")
    parser.add_argument("--plot", metavar="FILE.png", help="write a plot of device reads per request against memory")
    parser.add_argument("--json", action="store_true", help="print JSON rows instead of the table")
    _host_arguments(parser)
    gen = parser.add_argument_group("trace generation (instead of a replay)")
    gen.add_argument("--generate", choices=GENERATE_KINDS, help="write a synthetic trace to --out")
    gen.add_argument("--out", metavar="FILE.csv", help="where --generate writes")
    gen.add_argument("--gen-size", type=size_arg, default=1 << 30, help="image size (default 1GiB)")
    gen.add_argument("--count", type=int, default=100_000, help="requests (default 100000)")
    gen.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    gen.add_argument("--rate", type=float, default=100.0, help="requests per second (default 100)")
    gen.add_argument("--io-size", type=size_arg, default=4096, help="bytes per request (default 4KiB)")
    gen.add_argument("--dwell", type=float, default=None,
                     help="moving: seconds for the hot spot to move by its width (default 1200)")
    gen.add_argument("--theta", type=float, default=None, help="zipf: exponent (default 1.0)")


def _host_arguments(parser: argparse.ArgumentParser) -> None:
    """The host mode's options (``--vm``, ``--cap``, ``--memory``)."""
    host = parser.add_argument_group("host mode: several VMs against one pinned cap (instead of TRACE)")
    host.add_argument("--vm", action="append", default=[], metavar=VM_FORM,
                      help="one VM: its trace, metadata budget, guaranteed minimum, name, image size, and where "
                           "in its trace it starts (start=DURATION: the requests from there on, shifted to 0); "
                           "repeat. With --policy warm: the VMs restart from the sets a first run saved, their "
                           "warm-ups through one host budget of --warm-rate and each at --warm-rate")
    host.add_argument("--cap", type=_budgets, action="append", metavar="SIZE[,SIZE...]",
                      help="the host's pinned_cap (repeat or comma-separate)")
    host.add_argument("--memory", type=size_arg, default=None,
                      help="the host page cache every arm gets (default: 2 x the cap)")


def _model_params(items: list[str], block_size: int, interval: float | None) -> Any:
    from ..model.params import ModelParams

    given: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError("--model", item, "expected KEY=VALUE")
        given[key.strip()] = number_or_text(value.strip())
    if "block_size" in given or "interval" in given:
        raise ConfigError("--model", items, "set block_size and interval with --block-size and --interval")
    given["block_size"] = block_size
    if interval is not None:
        given["interval"] = interval
    try:
        return ModelParams.from_mapping(given, prefix="--model ")
    except ConfigError as err:
        if err.key == "--model block_size":
            raise ConfigError("--block-size", err.value, err.reason) from None
        raise


def _generate(args: argparse.Namespace) -> int:
    from ..replay import generate
    from ..replay.trace import write_csv

    if not args.out:
        raise ConfigError("--out", None, "--generate needs --out FILE.csv")
    extra: dict[str, Any] = {}
    if args.dwell is not None:
        extra["dwell"] = args.dwell
    if args.theta is not None:
        extra["theta"] = args.theta
    refused = set(extra) - {"moving": {"dwell"}, "zipf": {"theta"}}.get(args.generate, set())
    if refused:
        raise ConfigError("--generate", args.generate, "takes no " + ", ".join("--" + k for k in sorted(refused)))
    if args.count < 1:
        raise ConfigError("--count", args.count, "must be at least 1")
    try:
        trace = generate.GENERATORS[args.generate](args.gen_size, args.count, seed=args.seed, rate=args.rate,
                                                   io_size=args.io_size, **extra)
    except ValueError as err:
        raise ConfigError("--generate", args.generate, str(err)) from None
    try:
        write_csv(trace, args.out)
    except OSError as err:
        raise HostError(f"cannot write trace: {os.strerror(err.errno or 0)}", path=args.out, errno=err.errno) from err
    print(f"wrote {len(trace)} requests over {trace.duration:.0f}s of a {format_size(args.gen_size)} image "
          f"to {args.out}")
    return 0


def _vm(text: str, index: int) -> Any:
    """One ``--vm`` value as a HostVm (its trace read). Raises ConfigError, HostError."""
    from ..replay.host import HostVm

    path, *items = text.split(",")
    given: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in ("budget", "min", "name", "size", "start") or key in given:
            raise ConfigError(f"--vm[{index}]", text, f"use {VM_FORM}")
        given[key] = value
    if "budget" not in given:
        raise ConfigError(f"--vm[{index}]", text, "needs budget=SIZE")
    budget = parse_size(given["budget"], key=f"--vm[{index}] budget", allow_zero=False)
    minimum = parse_size(given.get("min", "0"), key=f"--vm[{index}] min")
    if minimum > budget:
        raise ConfigError(f"--vm[{index}] min", given["min"], "must not be above the budget")
    size = parse_size(given["size"], key=f"--vm[{index}] size") if "size" in given else None
    trace = _read(path, None)
    if "start" in given:
        trace = trace.since(parse_duration(given["start"], key=f"--vm[{index}] start"))
        if len(trace) == 0:
            raise ConfigError(f"--vm[{index}] start", given["start"], "is past the trace's last request")
    if size is not None and size < trace.end:
        raise ConfigError(f"--vm[{index}] size", given["size"], f"the trace reaches byte {trace.end}")
    name = given.get("name") or os.path.splitext(os.path.basename(path))[0]
    return HostVm(name, trace, budget, minimum, size)


def _read(path: str, fio_file: str | None) -> Any:
    from ..replay.trace import read_trace

    try:
        trace = read_trace(path, filename=fio_file)
    except OSError as err:
        raise HostError(f"cannot read trace: {os.strerror(err.errno or 0)}", path=path, errno=err.errno) from err
    if len(trace) == 0:
        raise ConfigError("trace", path, "has no requests")
    return trace


def _run_host(args: argparse.Namespace, params: Any) -> int:
    if args.trace:
        raise ConfigError("trace", args.trace, "give either a trace or --vm (host mode), not both")
    if not args.cap:
        raise ConfigError("--cap", None, "host mode needs the host's pinned cap")
    if args.cache_unit is not None and args.block_size % args.cache_unit:
        raise ConfigError("--cache-unit", args.cache_unit, f"must divide --block-size ({args.block_size})")
    from ..replay import host, report

    vms = [_vm(text, i) for i, text in enumerate(args.vm)]
    caps = sorted({c for group in args.cap for c in group})
    exact = (args.read_model or HostConfig.read_model) == "counted"  # the agents' default unless told
    if args.policy:
        if set(args.policy) != {"warm"}:
            raise ConfigError("--policy", args.policy, "host mode runs its arms; only --policy warm (a restart)")
        return _run_restart(args, params, vms, caps, exact)
    try:
        results = host.replay_host(vms, caps, block_size=args.block_size, params=params, memory=args.memory,
                                   rest=args.rest, prefetch_rate=args.prefetch_rate, cache_unit=args.cache_unit,
                                   fill=args.fill == "whole", exact=exact)
    except ValueError as err:
        raise ConfigError("--vm", args.vm, str(err)) from None
    if args.json:
        print(json.dumps([r.to_json() for r in results], indent=1))
    else:
        unit = f" (cached in {format_size(args.cache_unit)} units)" if args.cache_unit else ""
        reads = "counted" if exact else "inferred"
        print(f"host: {len(vms)} VMs, blocks {format_size(args.block_size)}{unit}, interval {params.interval:g}s, "
              + "memory " + (format_size(args.memory) if args.memory else "2 x cap") + f", reads {reads}")
        for vm in vms:
            print(f"  {vm.name}: {len(vm.trace)} requests, {vm.trace.duration:.0f}s, budget {format_size(vm.budget)}"
                  + (f", min {format_size(vm.minimum)}" if vm.minimum else ""))
        print("device reads per guest request, all VMs, by pinned cap:")
        print(report.table([r.total for r in results], corner="cap"))
        print("read hit ratio, all VMs:")
        print(report.table([r.total for r in results], measure="read_hits", corner="cap"))
        print("units vmcache's pins loaded per guest request (device reads beside the misses above):")
        loading = [r.total for r in results if "loaded_per_request" in r.total.extra]
        print(report.table(loading, measure="loads", corner="cap"))
        print(f"{report.MEASURES['load_use']}:")
        print(report.table(loading, measure="load_use", corner="cap"))
        print("per VM: device reads per request, mean grant")
        print(report.host_table(results))
    if args.plot:
        memory = format_size(args.memory) if args.memory else "2 x cap"
        _write_plot(args.plot, report.plot_png([r.total for r in results],
                                               title="host: device reads per request vs pinned cap",
                                               x_label=f"pinned cap (memory: {memory})"))
    return 0


def _run_restart(args: argparse.Namespace, params: Any, vms: list[Any], caps: list[int], exact: bool) -> int:
    """``--vm ... --policy warm``: the VMs' cold run, then their restart from the sets it saved, paced by one host
    budget and by a rate each (vmcache.replay.hostwarm)."""
    from ..replay import hostwarm, restartreport

    if args.fill != "whole":
        raise ConfigError("--fill", args.fill, "a restart restores its sets: pins fill whole")
    prefetch = HostConfig.prefetch_rate if args.prefetch_rate is None else args.prefetch_rate
    warm = args.warm_rate or HostConfig.warm_rate
    if prefetch is None:
        raise ConfigError("--prefetch-rate", "unlimited", "a restart is paced: give a rate")
    try:
        results = hostwarm.replay_restart(vms, caps, block_size=args.block_size, warm_rate=warm,
                                          prefetch_rate=prefetch, params=params, memory=args.memory, rest=args.rest,
                                          cache_unit=args.cache_unit, exact=exact)
    except ValueError as err:
        raise ConfigError("--vm", args.vm, str(err)) from None
    if args.json:
        print(json.dumps([r.to_json() for r in results], indent=1))
        return 0
    print(f"restart: {len(vms)} VMs, blocks {format_size(args.block_size)}, interval {params.interval:g}s, prefetch "
          f"{format_size(prefetch)}/s each, memory " + (format_size(args.memory) if args.memory else "2 x cap")
          + "; a first run together (cold, the benefit split) saves each VM's set, a second starts from it")
    print(restartreport.restart_tables(results))
    return 0


def _default_budgets(trace: Any, unit: int) -> list[int]:
    """The trace's footprint (units touched, rounded to whole MiB) / DEFAULT_FRACTIONS, at least one unit each."""
    import numpy as np

    from ..replay.accesses import to_blocks

    footprint = int(np.unique(to_blocks(trace, unit).block).size) * unit
    mib = 1 << 20
    return sorted({max(unit, footprint // f // mib * mib) for f in DEFAULT_FRACTIONS})


def _rates(prefetch: int | None, warm: int | None) -> str:
    """The prefetch limit as the table's header line says it (nothing when there is none)."""
    if prefetch is None:
        return ""
    return f", prefetch {format_size(prefetch)}/s" + (f", warm {format_size(warm)}/s" if warm else "")


def _write_plot(path: str, png: bytes) -> None:
    try:
        with open(path, "wb") as out:
            out.write(png)
    except OSError as err:
        raise HostError(f"cannot write plot: {os.strerror(err.errno or 0)}", path=path, errno=err.errno) from err


def run(args: argparse.Namespace) -> int:
    if args.generate:
        if args.trace:
            raise ConfigError("trace", args.trace, "give either a trace to replay or --generate, not both")
        return _generate(args)
    if args.vm:
        return _run_host(args, _model_params(args.model, args.block_size, args.interval))
    if not args.trace:
        raise ConfigError("trace", None, "a trace file is needed (or --generate KIND --out FILE, or --vm ...)")
    if args.read_model is not None:
        raise ConfigError("--read-model", args.read_model, "is for host mode (--vm); for a single trace choose "
                          "--policy vmcache (reads counted) or --policy inferred")
    if not 0.0 < args.pin_share <= 1.0:
        raise ConfigError("--pin-share", args.pin_share, "must be in (0, 1]")
    params = _model_params(args.model, args.block_size, args.interval)
    unit = args.block_size if args.cache_unit is None else args.cache_unit
    if unit < 1 or args.block_size % unit:
        raise ConfigError("--cache-unit", args.cache_unit, f"must divide --block-size ({args.block_size})")

    from ..replay import report, sim  # numpy only once the arguments are good

    trace = _read(args.trace, args.fio_file)
    size = args.size if args.size is not None else trace.end
    if size < trace.end:
        raise ConfigError("--size", args.size, f"the trace reaches byte {trace.end}")
    if args.budget:
        budgets = sorted({b for group in args.budget for b in group})
    else:
        budgets = _default_budgets(trace, unit)
    policies = tuple(dict.fromkeys(args.policy)) if args.policy else sim.POLICIES
    results = sim.replay(trace, budgets, block_size=args.block_size, params=params, pin_share=args.pin_share,
                         size_bytes=size, policies=policies, head=args.head, prefetch_rate=args.prefetch_rate,
                         warm_rate=args.warm_rate, cache_unit=unit, rest=args.rest, fill=args.fill == "whole")
    if args.json:
        print(json.dumps(report.rows_json(results), indent=1))
    else:
        paged = unit != args.block_size
        print(f"{os.path.basename(args.trace)}: {len(trace)} requests, {trace.duration:.0f}s, image "
              f"{format_size(size)}, blocks {format_size(args.block_size)}, interval {params.interval:g}s, "
              f"pin share {args.pin_share:g}, rest {args.rest}" + _rates(args.prefetch_rate, args.warm_rate)
              + (", pins fill only what is cached" if args.fill == "cached" else "")
              + (f", cache unit {format_size(unit)}" if paged else ""))
        for measure, title in report.MEASURES.items():
            print(f"{title}:")
            print(report.table(results, measure=measure))
            if args.head is not None and measure != "hits":
                print(f"{title} over the first {args.head:g}s:")
                print(report.table(results, measure=measure, first=True))
    if args.plot:
        title = f"{os.path.basename(args.trace)}: device reads vs memory"
        _write_plot(args.plot, report.plot_png(results, title=title))
    return 0
