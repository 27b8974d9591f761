"""Why the agent manages its domain, with what settings: the domain's metadata or a host rule.

The agent re-decides whenever either changes (a metadata-change event, a
changed host config); :func:`vmcache.settings.rules.decide` is the decision,
this keeps what it is made from between cycles.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ..settings.metadata import DomainInfo, DomainSettings
from ..settings.rules import Rule, decide

__all__ = ["Management"]


class Management:
    """The host rules in force and the domain's XML as last read; ``why`` names what opts it in."""

    def __init__(self, rules: Sequence[Rule]) -> None:
        self.rules = tuple(rules)
        self.why = ""
        self._facts: DomainInfo | None = None  # the XML as libvirt has it (the metadata as written)

    def effective(self, info: DomainInfo) -> DomainInfo:
        """``info`` with the settings the agent goes by: its metadata's, or the host rule's that opts it in."""
        self._facts = info
        opt_in = decide(info, self.rules)
        self.why = opt_in.why
        return replace(info, settings=opt_in.settings)

    def still_managed(self, settings: DomainSettings | None) -> bool:
        """Whether the domain is managed with metadata ``settings`` (a hot set is saved only then)."""
        return self._facts is not None and decide(replace(self._facts, settings=settings), self.rules).enabled

    def take_rules(self, rules: Sequence[Rule]) -> bool:
        """Go by ``rules`` from now on; True when they differ from the ones in force."""
        if tuple(rules) == self.rules:
            return False
        self.rules = tuple(rules)
        return True
