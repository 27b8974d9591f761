"""``vmcache agent --domain NAME``: the per-domain agent (started by the libvirt hook)."""

from __future__ import annotations

import argparse
import logging
import os

from ._host import add_host_options, host_config

NAME = "agent"
HELP = "run the agent of one domain (the libvirt hook starts it; see docs/install.md)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--domain", required=True, help="libvirt domain name")
    parser.add_argument("--domain-id", type=int, default=None, metavar="ID",
                        help="the run of the domain to follow (libvirt's domain id; the hook passes it)")
    add_host_options(parser)


def run(args: argparse.Namespace) -> int:
    from ..service.app import build_agent
    from ..service.detached import wait_for_pidfile

    if not args.verbose:
        logging.getLogger().setLevel(logging.INFO)
    config = host_config(args)
    wait_for_pidfile(args.domain, args.domain_id)  # a successor started while the previous run's agent was stopping
    return build_agent(args.domain, config, uri=args.uri, domain_id=args.domain_id,
                       config_path=os.path.abspath(args.host_config)).run()
