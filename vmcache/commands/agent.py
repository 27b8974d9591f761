"""``vmcache agent --domain NAME``: the per-domain agent (started by the libvirt hook)."""

from __future__ import annotations

import argparse
import logging

from ._host import add_host_options, host_config

NAME = "agent"
HELP = "run the agent of one domain (the libvirt hook starts it; see docs/install.md)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--domain", required=True, help="libvirt domain name")
    add_host_options(parser)


def run(args: argparse.Namespace) -> int:
    from ..service.app import build_agent

    if not args.verbose:
        logging.getLogger().setLevel(logging.INFO)
    config = host_config(args)
    return build_agent(args.domain, config, uri=args.uri).run()
