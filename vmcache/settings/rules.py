"""Host rules: which domains vmcache manages without a word in their XML (pure).

Fleet managers (OpenStack Nova, oVirt's VDSM) write a domain's XML afresh
at every start, so an element vmcache keeps there does not last. The host
config's ``domains:`` list opts domains in by what the manager writes
itself (docs/configuration.md, "Host rules")::

    domains:
      - match: {name: "web-*"}            # glob on the libvirt domain name
        budget: 2G
      - match: {nova_flavor: "m1.large"}  # <nova:flavor name="..."> (glob)
        budget: 4G
        min: 1G
      - match: {nova_project: "3f0e..."}  # <nova:owner><nova:project uuid="...">
      - match: {uuid: "..."}              # the domain's uuid (Nova's instance uuid)
        enabled: no                       # keep matching domains out

A rule matches when every key of its ``match`` does; the first rule that
matches decides. Precedence (:func:`decide`): the domain's own vmcache
metadata, ``enabled="no"`` included, over the rules, over the default: off.

Parsing (:func:`parse_rules`) names the rule and its line in every error;
an unknown key is refused. No I/O, and no XML code: the libvirt hook loads
this module with every cached config (the domain's facts come from
:mod:`vmcache.settings.metadata`, imported only where XML is parsed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from ..units import parse_size
from .yamltext import key_text, line_of, no_unknown

if TYPE_CHECKING:
    from .metadata import DomainInfo, DomainSettings

__all__ = ["MATCH_KEYS", "Match", "Rule", "OptIn", "parse_rules", "rules_from_json", "decide"]

#: What a rule can match on, in the order a rule is described.
MATCH_KEYS = ("name", "uuid", "nova_flavor", "nova_project")
_RULE_KEYS = ("match", "budget", "min", "enabled")
_TRUE = ("yes", "true", "on")
_FALSE = ("no", "false", "off")


@dataclass(frozen=True)
class Match:
    """What a domain must have for a rule to apply: every key given (globs for ``name`` and ``nova_flavor``)."""

    name: str | None = None
    uuid: str | None = None
    nova_flavor: str | None = None
    nova_project: str | None = None

    def matches(self, info: DomainInfo) -> bool:
        nova = info.nova
        if self.name is not None and not fnmatchcase(info.name, self.name):
            return False
        if self.uuid is not None and info.uuid.lower() != self.uuid:
            return False
        if self.nova_flavor is not None and (nova is None or nova.flavor is None
                                             or not fnmatchcase(nova.flavor, self.nova_flavor)):
            return False
        return self.nova_project is None or (nova is not None and (nova.project or "").lower() == self.nova_project)

    def __str__(self) -> str:
        return ", ".join(f"{key}={value}" for key in MATCH_KEYS if (value := getattr(self, key)) is not None)


@dataclass(frozen=True)
class Rule:
    """One entry of ``domains:``: ``index`` counts from 1, ``line`` is where it starts in the file."""

    index: int
    match: Match
    enabled: bool = True
    budget: int | None = None
    minimum: int | None = None
    line: int | None = None

    def settings(self) -> DomainSettings:
        """The settings a domain this rule decides gets (as if its metadata said them)."""
        from .metadata import DomainSettings  # xml.etree: not on the hook's path for domains no rule is about

        return DomainSettings(enabled=self.enabled, budget=self.budget, minimum=self.minimum)

    def __str__(self) -> str:
        return f"rule {self.index}: {self.match}" + ("" if self.enabled else " (enabled: no)")


@dataclass(frozen=True)
class OptIn:
    """Whether vmcache manages a domain, with what settings, and why (``vmcache status`` shows ``why``)."""

    settings: DomainSettings | None
    why: str

    @property
    def enabled(self) -> bool:
        return self.settings is not None and self.settings.enabled


def decide(info: DomainInfo, rules: Sequence[Rule]) -> OptIn:
    """The domain's own metadata if it has vmcache's element, else the first rule that matches, else off."""
    if info.settings is not None:
        return OptIn(info.settings, "metadata" if info.settings.enabled else "metadata enabled=no")
    for rule in rules:
        if rule.match.matches(info):
            return OptIn(rule.settings(), str(rule))
    return OptIn(None, "no vmcache metadata, no rule matches" if rules else "no vmcache metadata")


# -- parsing -------------------------------------------------------------------------------------


def parse_rules(value: object) -> tuple[Rule, ...]:
    """The ``domains:`` list of a host config (as :func:`vmcache.settings.yamltext.load_yaml` gives it).

    Raises ConfigError naming the rule (``domains[N]``), its line and the key.
    """
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ConfigError("domains", value, "must be a list of rules, each with a match (docs/configuration.md)")
    return tuple(_rule(item, index) for index, item in enumerate(value, start=1))


def _where(index: int, line: int | None) -> str:
    return f"domains[{index}]" + (f" (line {line})" if line is not None else "")


def _rule(item: object, index: int) -> Rule:
    line = line_of(item)
    where = _where(index, line)
    if not isinstance(item, dict):
        raise ConfigError(where, item, "must be a mapping with a match, e.g. {match: {name: 'web-*'}, budget: 2G}")
    no_unknown(item, _RULE_KEYS, where + " ")
    if "match" not in item:
        raise ConfigError(where, dict(item), "has no match (e.g. match: {name: 'web-*'})")
    budget = None if item.get("budget") is None else parse_size(item["budget"], key=f"{where} budget")
    minimum = None if item.get("min") is None else parse_size(item["min"], key=f"{where} min")
    if minimum is not None and budget is not None and minimum > budget:
        raise ConfigError(f"{where} min", item["min"], f"must not be above the budget ({item['budget']})")
    return Rule(index=index, match=_match(item["match"], where), enabled=_enabled(item.get("enabled", True), where),
                budget=budget, minimum=minimum, line=line)


def _enabled(value: object, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ConfigError(f"{where} enabled", value, "must be yes or no")


def _match(value: object, where: str) -> Match:
    if not isinstance(value, dict) or not value:
        raise ConfigError(f"{where} match", value, "must be a mapping of one or more of " + ", ".join(MATCH_KEYS))
    no_unknown(value, MATCH_KEYS, f"{where} match.")
    found: dict[str, str] = {}
    for key, text in value.items():
        if not isinstance(text, str) or not text.strip() or not text.isprintable():
            raise ConfigError(f"{where} match.{key_text(key)}", text, "must be a non-empty string (quote it)")
        # uuids are compared as libvirt and Nova print them: lower case
        found[key] = text.strip().lower() if key in ("uuid", "nova_project") else text.strip()
    return Match(**found)


def rules_from_json(data: Sequence[dict[str, Any]]) -> tuple[Rule, ...]:
    """The rules of a cached config (vmcache.settings.config.config_to_json's form). KeyError/TypeError if odd."""
    return tuple(Rule(**{**rule, "match": Match(**rule["match"])}) for rule in data)
