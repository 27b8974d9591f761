"""``vmcache enable DOMAIN --budget 2G``: opt a domain in through its metadata.

Writes vmcache's element into the domain's ``<metadata>`` with
virDomainSetMetadata (docs/metadata.md). Other settings already there
(per-disk overrides, model parameters) are kept unless options change them.
With ``--live`` (or neither flag on a running domain) the running domain
gets it too and its agent is started if it does not run yet; a running
agent picks the change up from libvirt's metadata-change event.
"""

from __future__ import annotations

import argparse
import dataclasses

from ..errors import ConfigError
from ..host.virtdomain import Affect, VirtDomain, connect
from ..settings.metadata import DiskOverride, DomainSettings, build_settings, parse_settings
from ..units import format_size, parse_size
from ._args import size_arg
from ._host import add_host_options, ensure_agent, host_config

NAME = "enable"
HELP = "opt a domain in: set vmcache's metadata (budget, per-disk overrides)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("domain", help="libvirt domain name")
    parser.add_argument("--budget", type=size_arg, help="bytes to keep resident for this domain, e.g. 2G "
                                                         "(default: what the metadata says, else the host default)")
    parser.add_argument("--min", type=size_arg, dest="minimum",
                        help="bytes of the host's pinned cap guaranteed to this domain (at most its budget)")
    parser.add_argument("--exclude", action="append", default=[], metavar="DEV",
                        help="leave disk DEV (target dev, e.g. vdb) alone; repeatable")
    parser.add_argument("--include", action="append", default=[], metavar="DEV",
                        help="manage disk DEV again (undoes --exclude); repeatable")
    parser.add_argument("--disk-budget", action="append", default=[], metavar="DEV=SIZE",
                        help="own budget of disk DEV, e.g. vdc=512M; DEV=default: none, it shares the "
                             "domain's rest again; repeatable")
    add_affect_options(parser)
    add_host_options(parser)


def add_affect_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--live", action="store_true", help="change the running domain")
    parser.add_argument("--config", action="store_true", help="change the persistent definition")


def affect(args: argparse.Namespace) -> Affect:
    """--live/--config as libvirt flags; neither: the current state (live if running)."""
    flags = Affect.CURRENT
    if args.live:
        flags |= Affect.LIVE
    if args.config:
        flags |= Affect.CONFIG
    return flags


def touches_live(flags: Affect, active: bool) -> bool:
    """Whether a change with ``flags`` reaches the running domain."""
    return active and (bool(flags & Affect.LIVE) or flags == Affect.CURRENT)


def read_from(flags: Affect, active: bool) -> Affect:
    """Which definition to read the current settings from: the persistent one when only
    it is changed or the domain is not running, else the live one."""
    if not active or (flags & Affect.CONFIG and not flags & Affect.LIVE):
        return Affect.CONFIG
    return Affect.LIVE


def _disk_budgets(items: list[str]) -> dict[str, int | None]:
    """``DEV=SIZE`` items by dev; ``DEV=default`` gives None (no budget of its own)."""
    budgets: dict[str, int | None] = {}
    for item in items:
        dev, sep, size = item.partition("=")
        if not sep or not dev:
            raise ConfigError("--disk-budget", item, "use DEV=SIZE, e.g. vdc=512M")
        budgets[dev] = None if size == "default" else parse_size(size, key=f"--disk-budget {dev}")
    return budgets


def updated(current: DomainSettings | None, args: argparse.Namespace) -> DomainSettings:
    """The settings ``current`` becomes: enabled, with the options applied."""
    settings = current or DomainSettings()
    disks = {d.dev: d for d in settings.disks}
    for dev in args.include:
        if dev in args.exclude:
            raise ConfigError("--include", dev, "also given to --exclude")
        disks[dev] = dataclasses.replace(disks.get(dev, DiskOverride(dev)), exclude=False)
    for dev in args.exclude:
        disks[dev] = dataclasses.replace(disks.get(dev, DiskOverride(dev)), exclude=True)
    for dev, disk_budget in _disk_budgets(args.disk_budget).items():
        disks[dev] = dataclasses.replace(disks.get(dev, DiskOverride(dev)), budget=disk_budget)
    disks = {dev: d for dev, d in disks.items() if d.exclude or d.budget is not None}  # nothing left: no element
    budget = settings.budget if args.budget is None else args.budget
    minimum = settings.minimum if getattr(args, "minimum", None) is None else args.minimum
    if minimum is not None and budget is not None and minimum > budget:
        raise ConfigError("--min", format_size(minimum), f"must not be above the budget ({format_size(budget)})")
    new = dataclasses.replace(settings, enabled=True, budget=budget, disks=tuple(disks.values()), minimum=minimum)
    return parse_settings(build_settings(new))  # what libvirt will hold, checked (e.g. DEV names)


def run(args: argparse.Namespace) -> int:
    config = host_config(args)
    flags = affect(args)
    dom = VirtDomain(connect(args.uri), args.domain)
    active = dom.is_active()
    new = updated(dom.settings(read_from(flags, active)), args)
    # build_settings/parse_settings validate; the domain's model overrides must fit ModelParams too
    config.model_params(new.model)
    if new.minimum is not None and new.budget is None and new.minimum > config.budget:
        raise ConfigError("--min", args.minimum,
                          f"must not be above the host default budget ({format_size(config.budget)})")
    dom.set_settings(new, flags)
    shown = format_size(new.budget) if new.budget is not None else f"host default {format_size(config.budget)}"
    print(f"{args.domain}: vmcache enabled, budget {shown}"
          + (f", guaranteed {format_size(new.minimum)}" if new.minimum else ""))
    if new.disks:
        print(f"{args.domain}: disks: " + "; ".join(_override(d) for d in new.disks))
    if touches_live(flags, active):
        result = ensure_agent(args, config, args.domain, running=True)
        print(f"{args.domain}: agent {result.action}" + (f" (pid {result.pid})" if result.pid else ""))
    return 0


def _override(disk: DiskOverride) -> str:
    """One disk's override as ``enable`` reports it."""
    if disk.exclude:
        return f"{disk.dev} excluded" + (f" (own budget {format_size(disk.budget)} kept)" if disk.budget else "")
    return f"{disk.dev} own budget {format_size(disk.budget or 0)}"
