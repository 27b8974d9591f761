"""``vmcache reconcile``: an agent for every running domain vmcache should manage, none for the others.

Looks at every running domain's XML (vmcache's metadata, Nova's) against
the host rules and at the agents that run (vmcache.service.reconcile):
starts the missing ones, stops those no longer wanted. ``systemctl reload
vmcache`` runs it, so does the Debian package's postinst, and a running
agent that notices a changed host config asks for it (``--if-changed``).
"""

from __future__ import annotations

import argparse
import os

from ..host.virtdomain import connect
from ..service.launcher import make_launcher
from ..service.reconcile import Outcome, reconcile_once
from ._host import add_host_options, host_config

NAME = "reconcile"
HELP = "start the agents running domains should have (host rules, metadata) and stop the others"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dry-run", action="store_true", help="only say what it would start and stop")
    parser.add_argument("--if-changed", action="store_true",
                        help="do nothing if this version of the host config was reconciled already (agents use it)")
    parser.add_argument("-q", "--quiet", action="store_true", help="print only what it started or stopped")
    add_host_options(parser)


def render(outcome: Outcome, *, dry_run: bool = False, quiet: bool = False) -> list[str]:
    """The lines reconcile prints: one per agent started or stopped, then a summary."""
    if outcome.skipped:
        return [] if quiet else ["this version of the host config was reconciled already"]
    lines = []
    if dry_run:
        lines += [f"{d.name}: would start an agent ({d.opt_in.why})" for d in outcome.plan.start]
        lines += [f"{d.name}: would stop agent {d.agent} ({d.opt_in.why})" for d in outcome.plan.stop]
    for domain, result in outcome.results:
        lines.append(f"{domain.name}: agent {result.action}" + (f" (pid {result.pid})" if result.pid else "")
                     + f" - {domain.opt_in.why}")
    lines += outcome.errors
    if not quiet:
        p = outcome.plan
        lines.append(f"{len(p.start) + len(p.keep)} running domains to manage: {len(p.keep)} with an agent, "
                     f"{len(p.start)} {'to start' if dry_run else 'started'}; "
                     f"{len(p.stop)} agents {'to stop' if dry_run else 'stopped'}")
    return lines


def run(args: argparse.Namespace) -> int:
    config = host_config(args)
    path = os.path.abspath(args.host_config)
    launcher = make_launcher(config, config_path=path)
    outcome = reconcile_once(lambda: connect(args.uri), config, path, launcher, if_changed=args.if_changed,
                             dry_run=args.dry_run)
    for line in render(outcome, dry_run=args.dry_run, quiet=args.quiet):
        print(line)
    return 1 if outcome.errors else 0
