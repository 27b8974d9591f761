"""Reconcile (against libvirt's in-process test driver) and what `vmcache status` shows around it.

test:///default has one running domain, ``test`` (id 1, no vmcache metadata):
host rules decide whether it should have an agent; run locks in a
temporary directory (or the host's, where no agent of that uuid can be)
say whether one manages it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import libvirt
import pytest

from vmcache.cli import main
from vmcache.host.files import try_lock
from vmcache.observe.status import AgentStatus, DiskStatus, status_path, write_status
from vmcache.service.launchresult import LaunchResult
from vmcache.service.reconcile import Plan, RunningDomain, plan, reconcile_once, survey
from vmcache.settings.config import parse_host_config
from vmcache.settings.metadata import NAMESPACE
from vmcache.settings.rules import OptIn

URI = "test:///default"
TEST_UUID = "6695eb01-f6a4-8304-79aa-97f2502e193f"  # the test driver's domain "test"
REPO = Path(__file__).resolve().parents[2]


class FakeLauncher:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, int | None]] = []

    def start(self, domain: str, domain_id: int | None = None) -> LaunchResult:
        self.calls.append(("start", domain, domain_id))
        return LaunchResult("started", domain, pid=4242)

    def stop(self, domain: str) -> LaunchResult:
        self.calls.append(("stop", domain, None))
        return LaunchResult("stopping", domain, pid=4343)


@pytest.fixture
def conn():
    libvirt.registerErrorHandler(lambda _c, _e: None, None)
    c = libvirt.open(URI)
    yield c
    c.close()


def xml(name: str, uuid: str, *, run: int | None = 3, metadata: str = "") -> str:
    run_id = f" id='{run}'" if run is not None else ""
    return f"<domain type='kvm'{run_id}><name>{name}</name><uuid>{uuid}</uuid><metadata>{metadata}</metadata></domain>"


def optin(enabled: bool) -> OptIn:
    from vmcache.settings.metadata import DomainSettings

    return OptIn(DomainSettings() if enabled else None, "why")


def test_plan_starts_missing_agents_and_stops_unwanted_ones() -> None:
    wanted_none = RunningDomain("a", "u-a", 1, optin(True))
    wanted_has = RunningDomain("b", "u-b", 1, optin(True), agent=11)
    unwanted_has = RunningDomain("c", "u-c", 1, optin(False), agent=12)
    unwanted_none = RunningDomain("d", "u-d", 1, optin(False))
    assert plan([wanted_none, wanted_has, unwanted_has, unwanted_none]) == Plan(
        start=(wanted_none,), stop=(unwanted_has,), keep=(wanted_has,))


def test_survey_reads_each_domain_against_the_rules_and_finds_agents_by_their_run_lock(tmp_path: Path) -> None:
    rules = parse_host_config("domains:\n  - match: {name: 'web-*'}\n    budget: 2G\n").rules
    fd, _ = try_lock(str(tmp_path / "00000000-0000-0000-0000-00000000000b.3.lock"), b"777\n")
    assert fd is not None
    opted = f"<v:cache xmlns:v='{NAMESPACE}' enabled='no'/>"
    found = survey(None, rules, lock_dir=str(tmp_path), domains=lambda _c: [
        ("web-a", xml("web-a", "00000000-0000-0000-0000-00000000000a")),
        ("web-b", xml("web-b", "00000000-0000-0000-0000-00000000000b", metadata=opted)),
        ("gone", xml("gone", "00000000-0000-0000-0000-00000000000c", run=None)),  # stopped meanwhile
        ("bad", "<domain"),
    ])
    os.close(fd)
    assert [(d.name, d.opt_in.why, d.agent) for d in found] == [
        ("web-a", "rule 1: name=web-*", None),
        ("web-b", "metadata enabled=no", 777),
        ("bad", found[2].opt_in.why, None),
    ]
    assert found[2].opt_in.why.startswith("unusable XML or metadata: domain XML")
    assert plan(found).start == (found[0],) and plan(found).stop == (found[1],)


def test_reconcile_once_starts_what_a_rule_wants_and_only_once_per_config_version(tmp_path: Path, conn) -> None:
    config_path = tmp_path / "vmcache.yaml"
    config_path.write_text(f"runtime_dir: {tmp_path}/run\ndomains:\n  - match: {{name: test}}\n")
    from vmcache.host.configfile import load_host_config

    config = load_host_config(str(config_path))
    launcher = FakeLauncher()
    outcome = reconcile_once(lambda: libvirt.open(URI), config, str(config_path), launcher,
                             lock_dir=str(tmp_path / "locks"))
    assert launcher.calls == [("start", "test", 1)] and not outcome.errors
    assert [d.opt_in.why for d, _ in outcome.results] == ["rule 1: name=test"]
    # an agent noticed the same change later: nothing to do for this version of the file
    again = reconcile_once(lambda: libvirt.open(URI), config, str(config_path), launcher, if_changed=True,
                           lock_dir=str(tmp_path / "locks"))
    assert again.skipped and launcher.calls == [("start", "test", 1)]
    # the file changes: the next agent's request runs again; an agent holds the run's lock now, none is started
    config_path.write_text(config_path.read_text() + "interval: 5s\n")
    (tmp_path / "locks").mkdir()
    fd, _ = try_lock(str(tmp_path / "locks" / f"{TEST_UUID}.1.lock"), b"99\n")
    third = reconcile_once(lambda: libvirt.open(URI), config, str(config_path), launcher, if_changed=True,
                           lock_dir=str(tmp_path / "locks"))
    assert fd is not None
    assert not third.skipped and third.plan.keep and launcher.calls == [("start", "test", 1)]
    # a rule gone: that agent is stopped
    config = parse_host_config(f"runtime_dir: {tmp_path}/run\n")
    fourth = reconcile_once(lambda: libvirt.open(URI), config, str(config_path), launcher,
                            lock_dir=str(tmp_path / "locks"))
    os.close(fd)
    assert launcher.calls[-1] == ("stop", "test", None) and fourth.plan.stop[0].agent == 99


def test_the_command_says_what_it_did_and_a_broken_config_is_one_line(tmp_path: Path, conn, capsys,
                                                                     monkeypatch) -> None:
    from vmcache.commands import reconcile as command

    launcher = FakeLauncher()
    monkeypatch.setattr(command, "make_launcher", lambda config, *, config_path: launcher)
    config = tmp_path / "vmcache.yaml"
    config.write_text(f"runtime_dir: {tmp_path}/run\ndomains:\n  - match: {{name: test}}\n    budget: 2G\n")
    assert main(["reconcile", "--dry-run", "--host-config", str(config), "--uri", URI]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "test: would start an agent (rule 1: name=test)",
        "1 running domains to manage: 0 with an agent, 1 to start; 0 agents to stop"]
    assert launcher.calls == []
    assert main(["reconcile", "--host-config", str(config), "--uri", URI]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "test: agent started (pid 4242) - rule 1: name=test"
    config.write_text("domains:\n  - match: {name: test}\n    budjet: 2G\n")
    assert main(["reconcile", "--host-config", str(config), "--uri", URI]) == 2
    assert capsys.readouterr().err.strip() == (
        "vmcache reconcile: domains[1] (line 2) budjet: '2G': unknown key (known: match, budget, min, enabled)")


# -- vmcache status around it ------------------------------------------------------------------------------


def _agent(agents: str, name: str) -> None:
    write_status(status_path(agents, name), AgentStatus(
        domain=name, pid=os.getpid(), state="running", budget_bytes=1 << 30, managed_by="rule 1: name=web-*",
        disks=[DiskStatus("vda", "/img/a", "writethrough", True, size_bytes=64 << 20)]))


def test_status_with_a_broken_config_shows_the_error_on_top_and_still_the_agents(tmp_path: Path, capsys) -> None:
    config = tmp_path / "vmcache.yaml"
    config.write_text(f"runtime_dir: {tmp_path}/run\ndomains:\n  - match: {{flavour: m1.large}}\n")
    for name in ("web-1", "web-2", "web-3", "web-4"):
        _agent(f"{tmp_path}/run/agents", name)
    assert main(["status", "--host-config", str(config), "--uri", URI]) == 2
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("host config: domains[1] (line 3) match.flavour: 'm1.large': unknown key")
    heads = [line for line in lines if line.startswith("web-")]
    assert len(heads) == 4 and all("running pid" in h and "(rule 1: name=web-*)" in h for h in heads), lines
    assert main(["status", "--json", "--host-config", str(config), "--uri", URI]) == 2
    captured = capsys.readouterr()
    rows = json.loads(captured.out)
    assert [r["domain"] for r in rows] == ["web-1", "web-2", "web-3", "web-4"]
    assert rows[0]["managed_by"] == "rule 1: name=web-*" and rows[0]["disks"][0]["size_bytes"] == 64 << 20
    assert captured.err.startswith("vmcache status: host config: domains[1] (line 3)")


def test_status_lists_a_running_domain_a_rule_opts_in_that_has_no_agent(tmp_path: Path, conn, capsys) -> None:
    config = tmp_path / "vmcache.yaml"
    config.write_text(f"runtime_dir: {tmp_path}/run\ndomains:\n  - match: {{name: te*}}\n")
    assert main(["status", "--host-config", str(config), "--uri", URI]) == 0
    assert capsys.readouterr().out.strip() == (
        "test: no agent, though opted in by rule 1: name=te* (`vmcache reconcile` starts it)")
    assert main(["status", "test", "--json", "--host-config", str(config), "--uri", URI]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["state"], row["running"], row["managed_by"], row["domain_id"]) == ("no agent", False,
                                                                                   "rule 1: name=te*", 1)


def test_a_closed_pipe_ends_every_command_quietly(tmp_path: Path) -> None:
    """`vmcache status --json | head -c 10`: no BrokenPipeError traceback, the exit status of a SIGPIPE."""
    config = tmp_path / "vmcache.yaml"
    config.write_text(f"runtime_dir: {tmp_path}/run\n")
    for i in range(300):  # far more than a pipe holds: the write itself meets the closed pipe
        _agent(f"{tmp_path}/run/agents", f"web-{i}")
    command = (f"{sys.executable} -m vmcache status --json --host-config {config} --uri {URI} | head -c 10;"
               " echo \" ${PIPESTATUS[0]}\"")
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.stderr == "" and done.stdout == '[\n {\n  "bu 141\n', (done.stdout, done.stderr)
