"""``vmcache disable DOMAIN``: opt a domain out.

Sets ``enabled="no"`` in vmcache's metadata (keeping budget and overrides
for a later ``vmcache enable``), or with ``--remove`` deletes the element
and the saved hot set.
When the running domain is changed its agent is stopped (it would also
stop by itself on libvirt's metadata-change event). ``--remove`` also
removes the host's copy of the hot set; a host rule that matches the
domain then decides whether it is managed (and keeps its agent), which
this says. A domain a host rule manages, without an element of its own,
gets one saying ``enabled="no"``, which wins over the rule.
"""

from __future__ import annotations

import argparse
import dataclasses

from ..host.hotstore import HotStore
from ..host.virtdomain import VirtDomain, connect
from ..settings.config import HostConfig
from ..settings.metadata import DomainSettings
from ..settings.rules import Rule
from ._host import add_host_options, ensure_agent, host_config
from .enable import add_affect_options, affect, read_from, touches_live

NAME = "disable"
HELP = "opt a domain out: mark vmcache's metadata disabled and stop its agent"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("domain", help="libvirt domain name")
    parser.add_argument("--remove", action="store_true",
                        help="delete vmcache's metadata element altogether, and the saved hot set")
    add_affect_options(parser)
    add_host_options(parser)


def _rule_of(config: HostConfig, dom: VirtDomain) -> Rule | None:
    """The host rule that opts the domain in when it has no vmcache metadata (None: none does)."""
    rule = next((r for r in config.rules if r.match.matches(dom.info())), None)
    return rule if rule is not None and rule.enabled else None


def run(args: argparse.Namespace) -> int:
    config = host_config(args)
    flags = affect(args)
    dom = VirtDomain(connect(args.uri), args.domain)
    active = dom.is_active()
    current = dom.settings(read_from(flags, active))
    if args.remove:
        dom.set_settings(None, flags)
        dom.set_hotset(None, flags)  # an agent told to stop saves nothing once the element is gone
        if config.hotset_dir is not None:
            HotStore(config.hotset_dir).remove(dom.uuid())
        print(f"{args.domain}: vmcache metadata and saved hot set removed")
        rule = _rule_of(config, dom)
        if rule is not None:  # the rules decide now: the domain stays managed
            print(f"{args.domain}: still managed by {rule} (host config); `vmcache disable` without --remove "
                  "opts it out")
            return 0
    elif current is None:
        rule = _rule_of(config, dom)
        if rule is None:
            print(f"{args.domain}: no vmcache metadata, nothing to disable")
        else:  # the element, enabled="no", wins over the rule (docs/configuration.md, "Precedence")
            dom.set_settings(DomainSettings(enabled=False), flags)
            print(f"{args.domain}: vmcache disabled (over {rule} of the host config; a fleet manager that defines "
                  "the domain afresh drops this: a rule with enabled: no keeps it out for good)")
    else:
        dom.set_settings(dataclasses.replace(current, enabled=False), flags)
        print(f"{args.domain}: vmcache disabled")
    if touches_live(flags, active):
        result = ensure_agent(args, config, args.domain, running=False)
        print(f"{args.domain}: agent {result.action}" + (f" (pid {result.pid})" if result.pid else ""))
    return 0
