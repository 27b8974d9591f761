"""Host rules: parsing (one line naming the rule and its line), matching, and the precedence of metadata."""

from __future__ import annotations

import json

import pytest

from vmcache.errors import ConfigError
from vmcache.settings.config import HostConfig, config_from_json, config_to_json, parse_host_config
from vmcache.settings.metadata import NAMESPACE, DomainSettings, parse_domain
from vmcache.settings.rules import Match, Rule, decide

from tests.nova import NOVA_1_0, NOVA_1_1, nova_instance

GiB = 1 << 30
UUID = "1B4E28BA-2FA1-11D2-883F-0016D3CCA427"
PROJECT = "3f0e5d1c-0b6a-4e2b-9c11-7a2a4f1e9d10"

RULES = """\
interval: 5s
domains:
  - match: {name: "web-*"}
    budget: 2G
  - match: {nova_flavor: "m1.large"}
    budget: 4G
    min: 1G
  - match: {nova_project: "3F0E5D1C-0B6A-4E2B-9C11-7A2A4F1E9D10"}
  - match: {uuid: "%s"}
    enabled: no
""" % UUID


def domain(name: str = "instance-0000002a", *, metadata: str = "", uuid: str = UUID) -> str:
    return (f"<domain type='kvm' id='7'><name>{name}</name><uuid>{uuid}</uuid><metadata>{metadata}</metadata>"
            "<devices><disk type='file' device='disk'><driver name='qemu' type='qcow2' cache='writethrough'/>"
            "<source file='/var/lib/nova/instances/x/disk'/><target dev='vda' bus='virtio'/></disk></devices>"
            "</domain>")


def vmcache(attrs: str = "budget='1G'") -> str:
    return f"<vmcache:cache xmlns:vmcache='{NAMESPACE}' {attrs}/>"


@pytest.fixture(scope="module")
def rules() -> tuple[Rule, ...]:
    return parse_host_config(RULES).rules


def test_rules_are_read_in_order_with_their_lines(rules):
    assert [(r.index, r.line) for r in rules] == [(1, 3), (2, 5), (3, 8), (4, 9)]
    assert rules[0] == Rule(1, Match(name="web-*"), budget=2 * GiB, line=3)
    assert rules[1] == Rule(2, Match(nova_flavor="m1.large"), budget=4 * GiB, minimum=GiB, line=5)
    assert rules[2].match.nova_project == PROJECT  # uuids compared in lower case, as libvirt and Nova print them
    assert rules[3].enabled is False and rules[3].match.uuid == UUID.lower()
    assert str(rules[1]) == "rule 2: nova_flavor=m1.large"
    assert str(rules[3]) == f"rule 4: uuid={UUID.lower()} (enabled: no)"
    assert parse_host_config("interval: 5s\n").rules == ()


@pytest.mark.parametrize(("namespace", "flavor", "expected"), [
    (NOVA_1_1, "m1.large", "rule 2: nova_flavor=m1.large"),
    (NOVA_1_0, "m1.large", "rule 2: nova_flavor=m1.large"),
    (NOVA_1_1, "m1.small", "no vmcache metadata, no rule matches"),
])
def test_a_nova_flavor_rule_matches_novas_own_metadata_in_both_namespaces(rules, namespace, flavor, expected):
    info = parse_domain(domain(metadata=nova_instance(flavor=flavor, namespace=namespace),
                               uuid="a0000000-0000-0000-0000-000000000001"))
    assert info.nova is not None and info.nova.namespace == namespace and info.nova.name == "moonbuggy"
    opt_in = decide(info, rules)
    assert opt_in.why == expected
    if opt_in.enabled:
        assert opt_in.settings == DomainSettings(budget=4 * GiB, minimum=GiB)


def test_a_project_rule_matches_the_owner_project_uuid(rules):
    info = parse_domain(domain(metadata=nova_instance(flavor="m1.small", project=PROJECT),
                               uuid="a0000000-0000-0000-0000-000000000001"))
    assert decide(info, rules).why == f"rule 3: nova_project={PROJECT}"
    assert decide(info, rules).settings == DomainSettings()  # the host default budget


def test_name_glob_first_match_wins_and_no_rule_means_off(rules):
    assert decide(parse_domain(domain("web-1", metadata=nova_instance(flavor="m1.large"))), rules).why \
        == "rule 1: name=web-*"
    assert decide(parse_domain(domain("db-1", uuid="a0000000-0000-0000-0000-000000000001")), rules).settings is None
    assert decide(parse_domain(domain("db-1")), ()).why == "no vmcache metadata"


def test_the_domains_own_metadata_wins_over_every_rule(rules):
    mine = parse_domain(domain("web-1", metadata=vmcache("budget='512M'")))
    assert decide(mine, rules).why == "metadata" and decide(mine, rules).settings.budget == 512 << 20
    off = parse_domain(domain("web-1", metadata=vmcache("enabled='no'")))
    assert decide(off, rules).why == "metadata enabled=no" and not decide(off, rules).enabled


def test_a_rule_with_enabled_no_keeps_matching_domains_out(rules):
    info = parse_domain(domain("db-7"))  # uuid UUID: rule 4
    opt_in = decide(info, rules)
    assert not opt_in.enabled and opt_in.settings is not None and opt_in.why.startswith("rule 4: uuid=")


@pytest.mark.parametrize(("text", "message"), [
    ("domains:\n  - match: {name: a}\n  - match: {flavor: m1.large}\n",
     "domains[2] (line 3) match.flavor: 'm1.large': unknown key (known: name, uuid, nova_flavor, nova_project)"),
    ("domains:\n  - match: {name: a}\n    budjet: 2G\n",
     "domains[1] (line 2) budjet: '2G': unknown key (known: match, budget, min, enabled)"),
    ("domains:\n\n  - budget: 2G\n", "domains[1] (line 3): {'budget': '2G'}: has no match"),
    ("domains:\n  - match: {}\n", "domains[1] (line 2) match: {}: must be a mapping of one or more of"),
    ("domains:\n  - match: {uuid: 12}\n", "domains[1] (line 2) match.uuid: 12: must be a non-empty string"),
    ("domains:\n  - match: {name: a}\n    budget: lots\n", "domains[1] (line 2) budget: 'lots': not a size"),
    ("domains:\n  - match: {name: a}\n    budget: 1G\n    min: 2G\n",
     "domains[1] (line 2) min: '2G': must not be above the budget (1G)"),
    ("domains:\n  - match: {name: a}\n    enabled: maybe\n", "domains[1] (line 2) enabled: 'maybe': must be yes or no"),
    ("domains:\n  - web-*\n", "domains[1]: 'web-*': must be a mapping with a match"),
    ("domains: {name: web}\n", "domains: {'name': 'web'}: must be a list of rules"),
])
def test_a_bad_rule_is_one_line_naming_the_rule_and_its_line(text, message):
    with pytest.raises(ConfigError) as err:
        parse_host_config(text)
    assert str(err.value).startswith(message), str(err.value)
    assert "\n" not in str(err.value)


def test_rules_survive_the_hooks_json_cache(rules):
    config = parse_host_config(RULES)
    again = config_from_json(json.loads(json.dumps(config_to_json(config))))
    assert again == config and again.rules == rules
    assert config_from_json(json.loads(json.dumps(config_to_json(HostConfig())))) == HostConfig()


def test_odd_or_partial_nova_metadata_is_never_an_error():
    partial = f"<nova:instance xmlns:nova='{NOVA_1_1}'><nova:flavor/><nova:owner/></nova:instance>"
    info = parse_domain(domain(metadata=partial))
    assert info.nova is not None and info.nova.flavor is None and info.nova.project is None
    rule = Rule(1, Match(nova_flavor="*"))
    assert not rule.match.matches(info)  # a flavor glob needs a flavor
    assert parse_domain(domain()).nova is None
