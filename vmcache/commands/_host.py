"""Options shared by the commands that act on this host's domains and agents."""

from __future__ import annotations

import argparse
import logging
import os

from ..host.configfile import load_host_config
from ..settings.config import DEFAULT_PATH, HostConfig
from ..service.launcher import make_launcher
from ..service.launchresult import LaunchResult

__all__ = ["add_host_options", "host_config", "ensure_agent"]

log = logging.getLogger("vmcache.commands")


def add_host_options(parser: argparse.ArgumentParser, *, uri: bool = True) -> None:
    parser.add_argument("--host-config", default=DEFAULT_PATH, metavar="PATH",
                        help=f"host configuration (default {DEFAULT_PATH})")
    if uri:
        parser.add_argument("--uri", default="qemu:///system", help="libvirt URI (default qemu:///system)")


def host_config(args: argparse.Namespace) -> HostConfig:
    """The host config named by --host-config; ConfigError if it is not valid."""
    return load_host_config(args.host_config)


def ensure_agent(args: argparse.Namespace, config: HostConfig, domain: str, *, running: bool) -> LaunchResult:
    """Start (``running``) or stop the domain's agent the way the hook does. Raises HostError."""
    # absolute: the agent runs detached from / (a relative path would name another file, or none)
    launcher = make_launcher(config, config_path=os.path.abspath(args.host_config))
    result = launcher.start(domain) if running else launcher.stop(domain)
    log.info(str(result))
    return result
