"""The libvirt hook: decisions, filters echoed byte for byte, exit 0 on anything, light imports."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import vmcache.service.hook as hook_module
from vmcache.host.configfile import cache_path
from vmcache.errors import HostError
from vmcache.service.hook import Action, run
from vmcache.service.launchresult import LaunchResult
from vmcache.settings.metadata import NAMESPACE

from tests.standin_agent import kill_agents

REPO = Path(__file__).resolve().parents[2]
STANDIN = str(REPO / "tests" / "standin_agent.py")


def domain_xml(name="web-1", metadata=f"<vmcache:cache xmlns:vmcache='{NAMESPACE}' budget='1G'/>"):
    return (f"<domain type='qemu'><name>{name}</name><uuid>1b4e28ba-2fa1-11d2-883f-0016d3cca427</uuid>"
            f"<metadata>{metadata}</metadata><devices><disk type='file' device='disk'>"
            "<driver name='qemu' type='raw' cache='writethrough'/><source file='/img/a.raw'/>"
            "<target dev='vda' bus='virtio'/></disk></devices></domain>").encode()


class FakeLauncher:
    def __init__(self, fail: bool = False):
        self.calls: list[tuple[str, str]] = []
        self.domain_ids: list[int | None] = []
        self.fail = fail
        self.config_path = None

    def __call__(self, config, *, config_path):
        self.config_path = config_path
        return self

    def start(self, domain, domain_id=None):
        self.calls.append(("start", domain))
        self.domain_ids.append(domain_id)
        if self.fail:
            raise HostError("cannot run agent /x: No such file or directory")
        return LaunchResult("started", domain, pid=42)

    def stop(self, domain):
        self.calls.append(("stop", domain))
        return LaunchResult("stopping", domain, pid=42)


BOMB = (b'<?xml version="1.0"?><!DOCTYPE domain [<!ENTITY a "aaaaaaaaaa"><!ENTITY b "&a;&a;&a;&a;&a;">]>'
        + domain_xml(name="&b;"))


@pytest.mark.parametrize(
    ("argv", "xml", "action", "reason"),
    [
        (["web-1", "started", "begin", "-"], domain_xml(), Action.START, "opted in"),
        (["web-1", "reconnect", "begin", "-"], domain_xml(), Action.START, "opted in"),
        (["web-1", "attach", "begin", "-"], domain_xml(), Action.START, "opted in"),
        (["web-1", "stopped", "end", "-"], domain_xml(), Action.STOP, "domain stopped"),
        (["web-1", "release", "end", "-"], b"", Action.STOP, "domain stopped"),
        (["web-1", "migrate", "begin", "-"], domain_xml(), Action.FILTER, "XML filter: written back unchanged"),
        (["web-1", "restore", "begin", "-"], b"junk", Action.FILTER, "XML filter: written back unchanged"),
        (["web-1", "prepare", "begin", "-"], domain_xml(), Action.FENCE, "a new run starts"),
        (["web-1", "prepare", "begin", "-"], domain_xml(metadata=""), Action.FENCE, "a new run starts"),
        (["web-1", "start", "begin", "-"], domain_xml(), Action.IGNORE, "not an operation vmcache acts on"),
        (["web-1", "started", "begin", "-"], domain_xml(metadata=""), Action.IGNORE, "no vmcache metadata"),
        (["web-1", "started", "begin", "-"],
         domain_xml(metadata=f"<vmcache:cache xmlns:vmcache='{NAMESPACE}' enabled='no'/>"),
         Action.IGNORE, "vmcache metadata says enabled=no"),
        (["web-1", "started", "begin", "-"],
         domain_xml(metadata=f"<vmcache:cache xmlns:vmcache='{NAMESPACE}' budget='lots'/>"),
         Action.IGNORE, "unusable XML or metadata: metadata budget: 'lots': not a size"),
        (["web-1", "started", "begin", "-"], b"<domain", Action.IGNORE, "no vmcache metadata"),  # not parsed
        (["web-1", "started", "begin", "-"], b"<domain xmlns:v='" + NAMESPACE.encode() + b"'", Action.IGNORE,
         "unusable XML or metadata: domain XML"),
        (["web-1", "started", "begin", "-"], BOMB, Action.IGNORE, "unusable XML or metadata: domain XML"),
        (["web-1", "started", "begin", "-"], domain_xml(name="other"), Action.IGNORE, "XML is for domain 'other'"),
        (["web-1"], b"", Action.IGNORE, "usage: DOMAIN OP SUBOP EXTRA"),
        ([], b"", Action.IGNORE, "usage: DOMAIN OP SUBOP EXTRA"),
    ],
)
def test_decisions(argv, xml, action, reason):
    decision, _, launcher = run_hook(argv, xml)
    assert decision.action is action
    assert decision.reason.startswith(reason), decision.reason
    assert [a for a, _ in launcher.calls] == ([action.value] if action in (Action.START, Action.STOP) else [])


def run_hook(args, data, *, config_path="/nonexistent.yaml", launcher=None, swept=None):
    """One hook call with a fake launcher; ``swept`` collects the release's sweeps (none of the host's files)."""
    out = io.BytesIO()
    launcher = launcher or FakeLauncher()
    swept = [] if swept is None else swept
    decision = run(args, io.BytesIO(data), out, config_path=config_path, launcher_for=launcher,
                   setup_logging=None, cache_dir=None, sweep=lambda config, domain, xml: swept.append(domain))
    return decision, out.getvalue(), launcher


def test_fast_path_namespace_is_vmcache_metadata_namespace():
    assert hook_module._NAMESPACE == NAMESPACE.encode()


def test_xml_without_the_namespace_is_ignored_unparsed(caplog, monkeypatch):
    """No vmcache namespace, no opt-in: the XML parser is not even loaded (it would refuse this)."""
    def refuse(*args):
        raise AssertionError("parsed the XML")

    monkeypatch.setattr(hook_module, "_decide_by_xml", refuse)
    caplog.set_level("INFO", logger="vmcache.service.hook")
    for xml in (domain_xml(name="plain", metadata=""), b"<domain", BOMB.replace(NAMESPACE.encode(), b"urn:x")):
        decision, _, launcher = run_hook(["plain", "started", "begin", "-"], xml)
        assert (decision.action, decision.reason, launcher.calls) == (Action.IGNORE, "no vmcache metadata", [])
    assert 'hook.ignore domain=plain op=started reason="no vmcache metadata"' in caplog.text


def test_entity_expansion_is_refused_on_the_start_path(caplog):
    caplog.set_level("INFO", logger="vmcache.service.hook")
    decision, _, launcher = run_hook(["web-1", "started", "begin", "-"], BOMB)
    assert decision.action is Action.IGNORE and launcher.calls == []
    assert "unusable XML or metadata" in caplog.text


def test_syslog_lines_are_daemon_facility_datagrams(tmp_path):
    import socket

    address = str(tmp_path / "log.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(address)
    log = hook_module.log
    before = list(log.handlers)
    try:
        hook_module._setup_logging(str(tmp_path / "unused"), syslog=address)
        log.info("hook.ignore domain=web-1")
        log.error("hook.failed domain=web-1")
        assert server.recv(4096) == f"<30>vmcache-hook[{os.getpid()}]: hook.ignore domain=web-1\0".encode()
        assert server.recv(4096) == f"<27>vmcache-hook[{os.getpid()}]: hook.failed domain=web-1\0".encode()
    finally:
        for handler in set(log.handlers) - set(before):
            log.removeHandler(handler)
            handler.close()
        server.close()
    assert not (tmp_path / "unused").exists()


@pytest.mark.parametrize("op", ["migrate", "restore"])
def test_filters_echo_the_xml_unchanged(op, tmp_path):
    xml = domain_xml() + b"\n<!-- \xc3\xbc trailing -->\n"
    bad_config = tmp_path / "bad.yaml"
    bad_config.write_text("budget: [")
    for config in ("/nonexistent.yaml", str(bad_config)):
        _, out, launcher = run_hook(["web-1", op, "begin", "-"], xml, config_path=config)
        assert out == xml
        assert launcher.calls == []


@pytest.mark.parametrize("op", ["migrate", "restore"])
def test_filters_carry_the_saved_hot_set_to_the_destination(op):
    """libvirt runs ``migrate begin`` on the destination with the incoming XML: what the hook writes back
    is what the domain gets there, so the saved hot set must come through byte for byte (also a hostile one:
    the hook does not read it)."""
    from vmcache.model.region import Region
    from vmcache.settings.hotset import DiskHotSet, HotSet, build_hotset, hotset_of

    record = DiskHotSet("vda", "/img/a.raw", 1 << 30, "0123456789abcdef", 1 << 20, (Region(0, 4 << 20, 8.0),))
    element = build_hotset(HotSet(saved=7, disks=(record,))).replace(
        "<hotset ", "<h:hotset xmlns:h='urn:x-vmcache:hotset:1' ", 1).replace("</hotset>", "</h:hotset>")
    element = element.replace("<disk ", "<h:disk ").replace("</disk>", "</h:disk>")
    outputs = []
    for extra in (element, "<h:hotset xmlns:h='urn:x-vmcache:hotset:1' version='9'>" + "A" * 70000 + "</h:hotset>"):
        xml = domain_xml(metadata=f"<vmcache:cache xmlns:vmcache='{NAMESPACE}' budget='1G'/>" + extra)
        _, out, launcher = run_hook(["web-1", op, "begin", "-"], xml)
        assert out == xml and launcher.calls == []
        outputs.append(out)
    assert hotset_of(outputs[0]).disk("vda") == record  # what the destination's agent will warm from


def test_other_ops_write_nothing():
    for op in ("started", "stopped", "prepare"):
        _, out, _ = run_hook(["web-1", op, "begin", "-"], domain_xml())
        assert out == b""


def test_prepare_fences_the_domains_earlier_runs_and_logs_it(caplog, tmp_path, monkeypatch):
    from vmcache.host import runlock
    from vmcache.host.rungate import RunGate

    monkeypatch.setattr(runlock, "RUN_LOCK_DIR", str(tmp_path))
    caplog.set_level("INFO", logger="vmcache.service.hook")
    old, other = RunGate(str(tmp_path)), RunGate(str(tmp_path))
    old.open("1b4e28ba-2fa1-11d2-883f-0016d3cca427", 3)
    other.open("00000000-2fa1-11d2-883f-0016d3cca427", 3)
    run_hook(["web-1", "prepare", "begin", "-"], domain_xml(metadata=""))  # opted out since: fenced all the same
    assert [p.name for p in tmp_path.iterdir()] == ["00000000-2fa1-11d2-883f-0016d3cca427.3.gate"]
    assert "hook.fence domain=web-1 runs=1" in caplog.text and "killed=none" in caplog.text
    caplog.clear()
    run_hook(["web-1", "prepare", "begin", "-"], domain_xml())
    assert caplog.text == ""  # nothing to fence: nothing logged


def test_start_and_stop_use_the_launcher(caplog):
    caplog.set_level("INFO", logger="vmcache.service.hook")
    _, _, launcher = run_hook(["web-1", "started", "begin", "-"], domain_xml())
    assert launcher.calls == [("start", "web-1")]
    assert launcher.config_path == "/nonexistent.yaml"
    assert "hook.start domain=web-1 op=started" in caplog.text
    _, _, launcher = run_hook(["web-1", "stopped", "end", "-"], domain_xml())
    assert launcher.calls == [("stop", "web-1")]


def test_no_metadata_means_no_agent_and_a_logged_reason(caplog):
    caplog.set_level("INFO", logger="vmcache.service.hook")
    _, _, launcher = run_hook(["plain", "started", "begin", "-"], domain_xml(name="plain", metadata=""))
    assert launcher.calls == []
    assert 'hook.ignore domain=plain op=started reason="no vmcache metadata"' in caplog.text


def test_bad_host_config_skips_start_but_still_stops(tmp_path, caplog):
    caplog.set_level("INFO", logger="vmcache.service.hook")
    bad = tmp_path / "bad.yaml"
    bad.write_text("budget: lots\n")
    decision, _, launcher = run_hook(["web-1", "started", "begin", "-"], domain_xml(), config_path=str(bad))
    assert decision.action is Action.IGNORE and launcher.calls == []
    assert "host config: budget: 'lots': not a size" in caplog.text
    _, _, launcher = run_hook(["web-1", "stopped", "end", "-"], domain_xml(), config_path=str(bad))
    assert launcher.calls == [("stop", "web-1")]


def test_a_host_rule_opts_a_domain_in_without_a_word_in_its_xml(tmp_path, caplog):
    """The XML Nova writes: no vmcache namespace at all; the rule by flavor (Nova 1.1 metadata) decides."""
    from tests.nova import nova_instance

    caplog.set_level("INFO", logger="vmcache.service.hook")
    rules = tmp_path / "rules.yaml"
    rules.write_text("domains:\n  - match: {name: 'web-*'}\n    budget: 2G\n"
                     "  - match: {nova_flavor: m1.large}\n    budget: 4G\n")
    nova = domain_xml(name="instance-0000002a", metadata=nova_instance(flavor="m1.large"))
    assert NAMESPACE.encode() not in nova
    decision, _, launcher = run_hook(["instance-0000002a", "started", "begin", "-"], nova, config_path=str(rules))
    assert (decision.action, decision.reason) == (Action.START, "opted in by rule 2: nova_flavor=m1.large")
    assert launcher.calls == [("start", "instance-0000002a")]
    decision, _, _ = run_hook(["web-7", "started", "begin", "-"], domain_xml(name="web-7", metadata=""),
                              config_path=str(rules))
    assert (decision.action, decision.reason) == (Action.START, "opted in by rule 1: name=web-*")
    # the domain's own metadata wins: enabled=no keeps it out whatever a rule says
    off = domain_xml(name="web-8", metadata=f"<vmcache:cache xmlns:vmcache='{NAMESPACE}' enabled='no'/>")
    decision, _, launcher = run_hook(["web-8", "started", "begin", "-"], off, config_path=str(rules))
    assert (decision.action, decision.reason, launcher.calls) == (Action.IGNORE, "vmcache metadata says enabled=no",
                                                                  [])
    decision, _, _ = run_hook(["db-1", "started", "begin", "-"], domain_xml(name="db-1", metadata=""),
                              config_path=str(rules))
    assert (decision.action, decision.reason) == (Action.IGNORE, "no vmcache metadata, no rule matches")


def test_a_broken_config_starts_nothing_and_says_why_for_every_start(tmp_path, caplog):
    caplog.set_level("INFO", logger="vmcache.service.hook")
    bad = tmp_path / "bad.yaml"
    bad.write_text("domains:\n  - match: {flavour: m1.large}\n")
    decision, _, launcher = run_hook(["web-1", "started", "begin", "-"], domain_xml(name="web-1", metadata=""),
                                     config_path=str(bad))
    assert decision.action is Action.IGNORE and launcher.calls == []
    assert decision.reason.startswith("host config: domains[1] (line 2) match.flavour: 'm1.large': unknown key")
    assert "hook.ignore domain=web-1" in caplog.text


def test_launcher_failure_is_logged_not_raised(caplog):
    caplog.set_level("INFO", logger="vmcache.service.hook")
    _, _, launcher = run_hook(["web-1", "started", "begin", "-"], domain_xml(), launcher=FakeLauncher(fail=True))
    assert launcher.calls == [("start", "web-1")]
    assert "hook.failed domain=web-1 op=started action=start" in caplog.text


# --- the real entry point, as libvirt runs it ------------------------------------


@pytest.fixture
def host(tmp_path):
    markers = tmp_path / "markers"
    markers.mkdir()
    config = tmp_path / "vmcache.yaml"
    config.write_text(f"runtime_dir: {tmp_path}/run\nlog_dir: {tmp_path}/log\n"
                      f"agent_command: [{sys.executable}, {STANDIN}, {markers}]\n")
    yield tmp_path, str(config), markers
    kill_agents(f"{tmp_path}/run/agents")
    Path(cache_path(str(config))).unlink(missing_ok=True)  # the real hook caches in /run/vmcache


def hook_process(config, args, stdin):
    """Run hooks/qemu's command line; returns (exit code, stdout, stderr, seconds)."""
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-I", "-m", "vmcache.service.hook", "--config", config, *args],
                          input=stdin, capture_output=True, timeout=30, cwd="/")
    return done.returncode, done.stdout, done.stderr, time.monotonic() - t0


def test_entry_point_starts_and_stops_the_agent(host):
    tmp_path, config, markers = host
    code, out, err, seconds = hook_process(config, ["web-1", "started", "begin", "-"], domain_xml())
    assert (code, out, err) == (0, b"", b"")
    deadline = time.monotonic() + 10

    def marker(name: str) -> str:
        """The stand-in's marker once written (it is created empty, then written: wait for its line)."""
        path = markers / name
        while not (path.exists() and path.read_text().endswith("\n")) and time.monotonic() < deadline:
            time.sleep(0.02)
        return path.read_text()

    pid = json.loads(marker("web-1.started"))["pid"]
    code, _, _, _ = hook_process(config, ["web-1", "stopped", "end", "-"], domain_xml())
    assert code == 0
    assert json.loads(marker("web-1.stopped")) == {"pid": pid, "signal": "TERM"}
    if not os.path.exists("/dev/log"):
        log = (tmp_path / "log" / "hook.log").read_text()
        assert "hook.start domain=web-1 op=started result=\"agent.started domain=web-1 pid=" in log
        assert "hook.stop domain=web-1 op=stopped result=\"agent.stopping domain=web-1 pid=" in log


@pytest.mark.parametrize(
    "args,stdin",
    [
        (["web-1", "started", "begin", "-"], b"\x00\xff garbage"),
        (["web-1", "started", "begin", "-"], domain_xml(metadata="<vmcache:cache xmlns:vmcache='urn:x' />")),
        ([], b""),
        (["web-1", "migrate", "begin", "-"], b"\xff\xfe not xml"),
    ],
)
def test_entry_point_exits_0_on_anything(host, args, stdin):
    _, config, markers = host
    code, out, _, _ = hook_process(config, args, stdin)
    assert code == 0
    assert out == (stdin if "migrate" in args else b"")
    assert list(markers.iterdir()) == []


def test_entry_point_exits_0_when_the_hook_itself_crashes(host, tmp_path):
    """Even an error vmcache did not foresee (here: an unreadable log dir and runtime dir) ends in exit 0."""
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    config = tmp_path / "crash.yaml"
    config.write_text(f"runtime_dir: {blocker}/run\nlog_dir: {blocker}/log\n")
    code, out, _, _ = hook_process(str(config), ["web-1", "started", "begin", "-"], domain_xml())
    assert (code, out) == (0, b"")


HEAVY = ("numpy", "scipy", "libvirt", "prometheus_client", "PIL", "qemu", "nbd")


def test_hook_imports_nothing_heavy(host, tmp_path):
    """The hook must answer libvirt within 100 ms: no numpy/scipy/libvirt/prometheus on its path."""
    _, config, markers = host
    dump = tmp_path / "modules.json"
    code = (
        "import json, sys\n"
        "from vmcache.service.hook import main\n"
        f"main(['--config', {config!r}, 'web-1', 'started', 'begin', '-'])\n"
        f"open({str(dump)!r}, 'w').write(json.dumps(sorted(sys.modules)))\n"
    )
    done = subprocess.run([sys.executable, "-I", "-c", code], input=domain_xml(), capture_output=True, timeout=30)
    assert done.returncode == 0, done.stderr
    modules = json.loads(dump.read_text())
    assert "vmcache.service.launcher" in modules and "defusedxml" in modules  # it did run the start path
    assert [m for m in modules if m.split(".")[0] in HEAVY] == []


def modules_loaded(config: str, name: str, tmp_path: Path) -> list[str]:
    """The modules a hook call for the start of ``name`` (no vmcache metadata) loaded, in a fresh interpreter."""
    dump = tmp_path / "modules.json"
    code = (
        "import json, sys\n"
        "from vmcache.service.hook import main\n"
        f"main(['--config', {config!r}, {name!r}, 'started', 'begin', '-'])\n"
        f"open({str(dump)!r}, 'w').write(json.dumps(sorted(sys.modules)))\n"
    )
    done = subprocess.run([sys.executable, "-I", "-c", code], input=domain_xml(name=name, metadata=""),
                          capture_output=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return json.loads(dump.read_text())


def test_settled_config_is_read_from_the_cache_without_yaml(host, tmp_path):
    """The common path: an unchanged host config, a domain without metadata: no PyYAML, no XML parser."""
    _, config, _ = host
    time.sleep(2.1)  # the cache keeps configs unchanged for 2 s
    code, _, _, _ = hook_process(config, ["web-1", "started", "begin", "-"], domain_xml())  # writes the cache
    assert code == 0 and os.path.exists(cache_path(config))
    modules = modules_loaded(config, "plain", tmp_path)
    assert "vmcache.settings.config" in modules
    assert [m for m in modules if m.split(".")[0] in ("yaml", "defusedxml", "xml")] == []
    assert "vmcache.service.launcher" not in modules and "logging.handlers" not in modules
    assert "vmcache.settings.rules" not in modules  # a host without rules never loads them


def test_with_rules_a_settled_config_is_still_read_without_yaml_and_the_xml_decides(host, tmp_path):
    _, config, markers = host
    with open(config, "a") as f:
        f.write("domains:\n  - match: {name: 'web-*'}\n")
    time.sleep(2.1)
    hook_process(config, ["plain", "started", "begin", "-"], domain_xml(name="plain", metadata=""))  # caches it
    modules = modules_loaded(config, "web-9", tmp_path)
    assert "yaml" not in modules and "defusedxml" in modules and "vmcache.service.launcher" in modules
    deadline = time.monotonic() + 10
    while not (markers / "web-9.started").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert (markers / "web-9.started").exists()  # the rule started its agent
    assert not (markers / "plain.started").exists()


def test_start_passes_the_run_id_of_the_xml_to_the_launcher():
    xml = domain_xml().replace(b"<domain type='qemu'>", b"<domain type='qemu' id='42'>")
    _decision, _out, launcher = run_hook(["web-1", "started", "begin", "-"], xml)
    assert launcher.calls == [("start", "web-1")] and launcher.domain_ids == [42]


def test_release_sweeps_after_the_stop_and_stopped_does_not():
    swept: list[str] = []
    _, _, launcher = run_hook(["web-1", "stopped", "end", "-"], domain_xml(), swept=swept)
    assert launcher.calls == [("stop", "web-1")] and swept == []  # QEMU may still be going down
    _, _, launcher = run_hook(["web-1", "release", "end", "-"], domain_xml(), swept=swept)
    assert launcher.calls == [("stop", "web-1")] and swept == ["web-1"]
