"""Under a fleet manager (issue 22): host rules opt domains in, reconcile mends what the hook could not do.

The domains are defined the way OpenStack Nova defines them: no vmcache
element in their XML, Nova's own ``<nova:instance>`` metadata (namespace
1.1, tests/nova.py) instead. The host config's ``domains:`` rules decide,
by name and by Nova flavor. A broken host config starts nothing (the hook
cannot tell which rules apply) and hides nothing (``vmcache status``);
once it is fixed, the running agents' reconcile - or the operator's -
starts what was missed. Domains are TCG, started paused, through the
installed test hook; everything is removed at the end.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

libvirt = pytest.importorskip("libvirt")

from vmcache.host.hotstore import HotStore  # noqa: E402
from vmcache.host.virtdomain import Affect, VirtDomain  # noqa: E402
from vmcache.settings.hotset import HOTSET_NAMESPACE  # noqa: E402
from vmcache.settings.metadata import NAMESPACE  # noqa: E402

from tests.live.livelib import MiB, LiveEnv, agents_env, wait_for  # noqa: E402

from tests.live.guestlib import covered, mapped, write_until_pinned  # noqa: E402
from tests.nova import nova_instance  # noqa: E402
from tests.pagecache_util import drop, vmlck  # noqa: E402

pytestmark = pytest.mark.live

PREFIX = f"vmcache-test-fl-{os.getpid()}-"
FLAVOR = f"m1.vmcache-test-{os.getpid()}"  # no domain of anyone else's has it
RULES = [
    {"match": {"name": PREFIX + "web-*"}, "budget": "12M"},
    {"match": {"nova_flavor": FLAVOR}, "budget": "20M", "min": "4M"},
]
BROKEN = [{"match": {"name": PREFIX + "web-*", "flavour": FLAVOR}}]


@pytest.fixture(scope="module")
def env(live_tmp: Path, hooked) -> Iterator[LiveEnv]:
    yield from agents_env(live_tmp, hooked, PREFIX, cap="256M", domains=RULES)


@pytest.fixture
def domains(env: LiveEnv) -> Iterator[LiveEnv]:
    """The env, its domains removed after the test and the config put back as the module wrote it."""
    yield env
    env.write_config()
    env.cleanup()


def vmcache(*args: str, env: LiveEnv) -> subprocess.CompletedProcess[str]:
    """``vmcache ARGS --host-config`` the module's config, as an operator runs it."""
    return subprocess.run([sys.executable, "-m", "vmcache", *args, "--host-config", str(env.config)],
                          capture_output=True, text=True, timeout=60)


def managed(env: LiveEnv, name: str) -> dict:
    try:
        return wait_for(lambda: (s := env.status(name)) and s["state"] in ("running", "backing-off") and s,
                        f"an agent of {name} to run a cycle")
    except AssertionError as err:
        raise AssertionError(f"{err}\nhook log:\n{env.hook_log()[-2000:]}\nagent log:\n{env.agent_log(name)[-2000:]}"
                             ) from None


def nova_metadata(flavor: str) -> str:
    return f"<metadata>{nova_instance(flavor=flavor)}</metadata>"


def test_a_rule_by_name_gives_an_agent_with_the_rules_budget_and_metadata_still_wins(domains: LiveEnv) -> None:
    env = domains
    name = PREFIX + "web-1"
    env.domain(name, metadata="")  # no vmcache element at all
    status = managed(env, name)
    assert status["managed_by"] == f"rule 1: name={PREFIX}web-*"
    assert status["budget_bytes"] == 12 * MiB and status["disks"][0]["budget_bytes"] == 12 * MiB
    assert status["disks"][0]["size_bytes"] == 64 * MiB
    out = vmcache("status", name, env=env).stdout
    assert out.startswith(f"{name}: running pid {status['pid']} (rule 1: name={PREFIX}web-*), budget 12MiB"), out
    # the domain's own metadata wins: enabled="no" keeps a domain the rule matches out
    off = PREFIX + "web-off"
    env.domain(off, metadata=f"<metadata><vmcache:cache xmlns:vmcache='{NAMESPACE}' enabled='no'/></metadata>")
    wait_for(lambda: f"domain={off} op=started" in env.hook_log(), "the hook's decision")
    assert env.agent_pid(off) is None and "vmcache metadata says enabled=no" in env.hook_log()


def test_a_rule_by_nova_flavor_manages_a_domain_defined_as_nova_defines_it(domains: LiveEnv) -> None:
    env = domains
    name = PREFIX + "instance-0000002a"
    dom = env.domain(name, metadata=nova_metadata(FLAVOR), persistent=True)
    assert "openstack.org/xmlns/libvirt/nova/1.1" in dom.XMLDesc(0) and NAMESPACE not in dom.XMLDesc(0)
    status = managed(env, name)
    assert status["managed_by"] == f"rule 2: nova_flavor={FLAVOR}"
    assert status["budget_bytes"] == 20 * MiB and status["minimum_bytes"] == 4 * MiB
    other = PREFIX + "instance-0000002b"
    env.domain(other, metadata=nova_metadata("m1.small"))
    wait_for(lambda: f"domain={other} op=started" in env.hook_log(), "the hook's decision")
    assert env.agent_pid(other) is None


def test_with_a_broken_config_status_shows_the_agents_and_fixing_it_lets_the_agents_reconcile(
        domains: LiveEnv) -> None:
    """Nothing starts while the config is broken; the running agent's reconcile starts it once it is fixed."""
    env = domains
    first, second = PREFIX + "web-2", PREFIX + "web-3"
    env.domain(first, metadata="")
    pid = managed(env, first)["pid"]
    env.write_config(domains=BROKEN)
    env.domain(second, metadata="")
    line = wait_for(lambda: next((ln for ln in env.hook_log().splitlines() if f"domain={second} op=started" in ln),
                                 None), "the hook's decision")
    assert "host config: domains[1] (line" in line and "match.flavour" in line, line
    wait_for(lambda: "config.unusable" in env.agent_log(first), "the agent to see the broken config")
    shown = vmcache("status", env=env)
    assert shown.returncode == 2, shown
    lines = shown.stdout.splitlines()
    assert lines[0].startswith("host config: domains[1] (line ") and "flavour" in lines[0], lines
    assert any(ln.startswith(f"{first}: running pid {pid} (rule 1: ") for ln in lines), lines
    rows = json.loads(vmcache("status", "--json", env=env).stdout)
    assert [r["domain"] for r in rows if r["running"]] == [first]
    assert env.agent_pid(second) is None and env.agent_pid(first) == pid  # the agent kept its config
    env.write_config()  # fixed: the agent notices, asks for a reconcile, which starts the missed agent
    assert managed(env, second)["managed_by"] == f"rule 1: name={PREFIX}web-*"
    assert env.agent_pid(first) == pid
    assert f"{second}: agent started (pid " in (env.logs / "reconcile.log").read_text()  # the agent's reconcile


def test_broken_then_fixed_with_no_agent_running_vmcache_reconcile_starts_it(domains: LiveEnv) -> None:
    env = domains
    name = PREFIX + "web-4"
    env.write_config(domains=BROKEN)
    env.domain(name, metadata="")
    wait_for(lambda: f"domain={name} op=started" in env.hook_log(), "the hook's decision")
    env.write_config()
    assert env.agent_pid(name) is None  # no agent saw the fix: nothing started by itself
    status = vmcache("status", "--json", env=env)
    (row,) = [r for r in json.loads(status.stdout) if r["domain"] == name]
    assert (row["state"], row["managed_by"]) == ("no agent", f"rule 1: name={PREFIX}web-*"), row
    done = vmcache("reconcile", env=env)
    assert done.returncode == 0, done
    assert f"{name}: agent started (pid " in done.stdout and f"- rule 1: name={PREFIX}web-*" in done.stdout
    assert managed(env, name)["budget_bytes"] == 12 * MiB
    again = vmcache("reconcile", env=env)
    assert f"{name}:" not in again.stdout  # nothing left to do


def test_nova_redefines_the_domain_without_vmcaches_elements_and_the_host_copy_warms_it(domains: LiveEnv) -> None:
    """A hard reboot as Nova does it: destroy, undefine, define its own XML (same uuid, no vmcache element), start.

    The image is evicted and the guest stays paused (it reads nothing): what the new agent locks came from
    the hot set kept on the host.
    """
    env = domains
    name = PREFIX + "instance-0000003c"
    dom = env.domain(name, metadata=nova_metadata(FLAVOR), persistent=True)
    uuid, image = dom.UUIDString(), env.tmp / f"{name}.raw"
    pid = managed(env, name)["pid"]
    write_until_pinned(dom, 8 * MiB, 4 * MiB, lambda: env.pinned(name), "the written regions to be pinned",
                       more=[(40 * MiB, 2 * MiB)])
    nova_xml = re.sub(r"<vmcachehot:hotset\b.*?</vmcachehot:hotset>", "",
                      dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE), flags=re.S)
    dom.destroy()
    wait_for(lambda: env.agent_pid(name) is None, "the agent to save and exit")
    copy = HotStore(str(env.tmp / "hotsets")).load(uuid)
    record = copy.disk("vda") if copy is not None else None
    assert copy is not None and record is not None and record.bytes >= 6 * MiB, copy
    dom.undefine()
    assert HOTSET_NAMESPACE not in nova_xml and NAMESPACE not in nova_xml and uuid in nova_xml
    drop(image)
    dom = env.live().defineXML(nova_xml)
    assert VirtDomain(env.live(), name).hotset(Affect.CONFIG) is None  # nothing of vmcache's in the new XML
    dom.createWithFlags(libvirt.VIR_DOMAIN_START_PAUSED)
    new = wait_for(lambda: (p := env.agent_pid(name)) and p != pid and p, "the new run's agent")
    status = wait_for(lambda: (s := env.status(name)) and s["disks"] and s["disks"][0]["warm_total_bytes"] and s,
                      "the new agent to warm")
    assert status["hotset_source"] == "host" and status["disks"][0]["warm_total_bytes"] == record.bytes
    assert f"hotset.loaded disks=1 saved={copy.saved} definition=host" in env.agent_log(name)
    wait_for(lambda: vmlck(new) >= record.bytes, "the saved regions to be locked again")
    ranges = mapped(new, image)
    for region in record.regions:
        assert covered(ranges, region.start, region.length), (region, ranges)
    # the new run's live XML carries the set again (what a migration or save of it would take along) as soon
    # as the agent holds it; until then the host's copy is the newest
    shown = vmcache("hotset", name, env=env)
    assert (shown.stdout.startswith(f"{name}: hot set from the host's copy ({env.tmp}/hotsets/{uuid}.xml)")
            or shown.stdout.startswith(f"{name}: hot set from the live definition")
            and "also in: the host's copy" in shown.stdout), shown
    live = wait_for(lambda: VirtDomain(env.live(), name).hotset(Affect.LIVE), "the set in the new run's live XML")
    carried = live.disk("vda")
    assert carried is not None
    assert {(r.start, r.length) for r in carried.regions} == {(r.start, r.length) for r in record.regions}


def test_vmcache_disable_keeps_a_rule_managed_domain_out_until_it_is_redefined(domains: LiveEnv) -> None:
    """Found by hand: disable said "nothing to disable", stopped the agent, and the next reconcile started it again."""
    env = domains
    name = PREFIX + "web-5"
    env.domain(name, metadata="")
    pid = managed(env, name)["pid"]
    done = vmcache("disable", name, env=env)
    assert done.returncode == 0 and f"{name}: vmcache disabled (over rule 1: name={PREFIX}web-*" in done.stdout, done
    wait_for(lambda: env.agent_pid(name) is None, "the agent to stop")
    again = vmcache("reconcile", env=env)
    assert again.returncode == 0 and f"{name}:" not in again.stdout, again.stdout
    assert env.agent_pid(name) is None and pid
    rows = [r for r in json.loads(vmcache("status", "--json", env=env).stdout) if r.get("domain") == name]
    assert rows == [], rows  # neither an agent nor "no agent": it is not managed
