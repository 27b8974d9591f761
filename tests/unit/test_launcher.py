"""Launcher: systemd path through a fake systemctl, detached path for real with a stand-in agent."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vmcache.settings.config import HostConfig, parse_host_config
from vmcache.errors import HostError
from vmcache.service import detached as detached_mod
from vmcache.service.detached import DetachedLauncher, remove_own_pidfile
from vmcache.service.launcher import default_agent_command, make_launcher
from vmcache.service.systemdunit import SystemdLauncher, systemd_escape
from vmcache.host.files import file_stem

from tests.procutil import open_files
from tests.standin_agent import kill_agents

STANDIN = str(Path(__file__).resolve().parents[1] / "standin_agent.py")


def wait_for(predicate, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def pid_gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.fixture
def host(tmp_path):
    """A host config under tmp_path, markers dir, and cleanup of any stand-in left running."""
    markers = tmp_path / "markers"
    markers.mkdir()
    config_path = tmp_path / "vmcache.yaml"
    config_path.write_text(
        f"runtime_dir: {tmp_path}/run\nlog_dir: {tmp_path}/log\n"
        f"agent_command: [{sys.executable}, {STANDIN}, {markers}]\n"
    )
    config = parse_host_config(config_path.read_text())
    yield config, str(config_path), markers
    kill_agents(config.agents_dir)


# --- systemd ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["web-1", "a b", ".hidden", "dom/with/slash", "ünï", "x:y_z.1", "-lead", "\\"])
def test_systemd_escape_matches_systemd_escape(name):
    tool = shutil.which("systemd-escape")
    if tool is None:
        pytest.skip("systemd-escape not installed")
    expected = subprocess.run([tool, "--", name], capture_output=True, text=True, check=True).stdout.strip()
    assert systemd_escape(name) == expected


def test_systemd_escape_examples():
    assert systemd_escape("web-1") == "web\\x2d1"
    assert systemd_escape("a b") == "a\\x20b"
    assert systemd_escape(".x") == "\\x2ex"


@pytest.fixture
def fake_systemctl(tmp_path, monkeypatch):
    """A systemctl on PATH that records its argv; exits with $FAKE_SYSTEMCTL_RC."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "systemctl.log"
    script = bindir / "systemctl"
    script.write_text(
        "#!/bin/sh\n"
        f'printf "%s\\n" "$*" >> {log}\n'
        'if [ -n "$FAKE_SYSTEMCTL_RC" ] && [ "$FAKE_SYSTEMCTL_RC" != 0 ]; then echo "Unit not found." >&2; fi\n'
        'exit "${FAKE_SYSTEMCTL_RC:-0}"\n'
    )
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    return log


def test_make_launcher_picks_systemd_when_it_runs(tmp_path):
    systemd_dir = tmp_path / "systemd"
    systemd_dir.mkdir()
    assert isinstance(make_launcher(HostConfig(), systemd_dir=str(systemd_dir)), SystemdLauncher)
    launcher = make_launcher(HostConfig(), systemd_dir=str(tmp_path / "absent"), config_path="/etc/x.yaml")
    assert isinstance(launcher, DetachedLauncher)
    assert launcher.argv("d") == [*default_agent_command(), "--host-config", "/etc/x.yaml", "--domain", "d"]
    assert launcher.agents_dir == "/run/vmcache/agents"


def test_systemd_start_and_stop_run_systemctl_no_block(fake_systemctl, tmp_path):
    systemd_dir = tmp_path / "systemd"
    systemd_dir.mkdir()
    launcher = make_launcher(HostConfig(), systemd_dir=str(systemd_dir))
    result = launcher.start("web-1")
    assert result.action == "start-requested"
    launcher.stop("web-1")
    assert fake_systemctl.read_text().splitlines() == [
        "--no-block start vmcache-agent@web\\x2d1.service",
        "--no-block stop vmcache-agent@web\\x2d1.service",
    ]
    assert str(result) == 'agent.start-requested domain=web-1 detail=vmcache-agent@web\\x2d1.service'


def test_systemd_failure_is_a_host_error(fake_systemctl, monkeypatch):
    monkeypatch.setenv("FAKE_SYSTEMCTL_RC", "5")
    with pytest.raises(HostError, match=r"systemctl start vmcache-agent@x.service failed \(5\): Unit not found."):
        SystemdLauncher().start("x")


def test_systemd_missing_binary_is_a_host_error():
    with pytest.raises(HostError, match="systemctl start"):
        SystemdLauncher(systemctl="/nonexistent/systemctl").start("x")


# --- detached -----------------------------------------------------------------


def test_detached_start_runs_agent_detached_and_second_start_is_noop(host):
    config, config_path, markers = host
    launcher = make_launcher(config, config_path=config_path, systemd_dir="/nonexistent")
    assert launcher.running("web 1") is None
    first = launcher.start("web 1")
    assert first.action == "started" and first.pid
    started = markers / (file_stem("web 1") + ".started")
    record = json.loads(wait_for(lambda: started.exists() and started.read_text(), what="stand-in start"))
    assert record["pid"] == first.pid
    assert record["argv"][-4:] == ["--host-config", config_path, "--domain", "web 1"]
    # double fork + setsid: a session of its own, of which it is not the leader (no tty can attach)
    assert record["sid"] != os.getsid(0) and record["sid"] != first.pid
    assert record["ppid"] != os.getpid()  # double fork: not our child
    # the pidfile holds the pid and is locked by the agent
    pidfile = Path(config.agents_dir) / (file_stem("web 1") + ".pid")
    assert pidfile.read_text().strip() == str(first.pid)
    assert launcher.running("web 1") == first.pid
    # stdio: stdin /dev/null, stdout/stderr the log file
    assert os.readlink(f"/proc/{first.pid}/fd/0") == "/dev/null"
    assert os.readlink(f"/proc/{first.pid}/fd/1") == f"{config.log_dir}/agent-web%201.log"
    # a second start does nothing
    second = launcher.start("web 1")
    assert (second.action, second.pid) == ("already-running", first.pid)
    assert len(started.read_text().splitlines()) == 1
    # stop: SIGTERM, returns at once, the agent goes
    t0 = time.monotonic()
    stop = launcher.stop("web 1")
    assert time.monotonic() - t0 < 0.1
    assert (stop.action, stop.pid) == ("stopping", first.pid)
    wait_for(lambda: pid_gone(first.pid), what="agent exit")
    assert json.loads((markers / (file_stem("web 1") + ".stopped")).read_text())["signal"] == "TERM"
    assert launcher.running("web 1") is None
    assert not pidfile.exists()  # removed by the agent as it exited
    assert launcher.stop("web 1").action == "not-running"
    # and a new start after a stale pidfile (an agent killed before it could remove it) works
    pidfile.write_text(f"{first.pid}\n")
    third = launcher.start("web 1")
    assert third.action == "started" and third.pid != first.pid
    launcher.stop("web 1")
    wait_for(lambda: pid_gone(third.pid), what="agent exit")


def test_detached_start_does_not_leak_our_fds(host, tmp_path):
    config, config_path, markers = host
    leaked = open(tmp_path / "leak", "w")  # noqa: SIM115 - must stay open while the agent starts
    os.set_inheritable(leaked.fileno(), True)
    try:
        launcher = make_launcher(config, config_path=config_path, systemd_dir="/nonexistent")
        pid = launcher.start("fds").pid
        wait_for(lambda: (markers / "fds.started").exists(), what="stand-in start")
        targets = open_files(pid)
        assert str(tmp_path / "leak") not in targets
        assert str(Path(config.agents_dir) / "fds.pid") in targets  # the lock it holds
    finally:
        leaked.close()
        launcher.stop("fds")


def test_concurrent_starts_give_one_agent(host):
    config, config_path, markers = host
    code = (
        "import sys; from vmcache.host.configfile import load_host_config; from vmcache.service.launcher import make_launcher;"
        f"c=load_host_config({config_path!r});"
        f"print(make_launcher(c, config_path={config_path!r}, systemd_dir='/nonexistent').start('race').action)"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(6)]
    actions = sorted(p.communicate(timeout=30)[0].strip() for p in procs)
    assert actions.count("started") == 1, actions
    assert actions.count("already-running") == 5, actions
    started = markers / "race.started"
    wait_for(lambda: started.exists(), what="stand-in start")
    time.sleep(0.2)
    assert len(started.read_text().splitlines()) == 1
    make_launcher(config, config_path=config_path, systemd_dir="/nonexistent").stop("race")


def test_a_start_that_locked_a_removed_pidfile_opens_the_new_one(tmp_path, monkeypatch):
    """An exiting agent unlinks its pidfile between a start's open and flock: the start must not
    lock the orphaned inode (a second start would then create a new file and a second agent)."""
    agents = tmp_path / "agents"
    launcher = DetachedLauncher([sys.executable, "-c", "import time; time.sleep(30)"], str(agents))
    real_flock = detached_mod.fcntl.flock
    replaced = []

    def flock(fd, op):
        if not replaced and op & detached_mod.fcntl.LOCK_EX:
            os.unlink(agents / "x.pid")  # what remove_own_pidfile does in the exiting agent
            replaced.append(fd)
        return real_flock(fd, op)

    monkeypatch.setattr(detached_mod.fcntl, "flock", flock)
    result = launcher.start("x")
    assert result.action == "started" and replaced
    try:
        assert launcher.running("x") == result.pid  # the lock is on the file the path names
        assert DetachedLauncher(["/bin/true"], str(agents)).start("x").action == "already-running"
    finally:
        os.kill(result.pid, signal.SIGKILL)
        wait_for(lambda: pid_gone(result.pid), what="sleeper exit")


def test_remove_own_pidfile_only_removes_the_file_it_holds_locked(tmp_path):
    path = tmp_path / "a.pid"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        env = {detached_mod.PIDFILE_ENV: str(path), detached_mod.PIDFILE_FD_ENV: str(fd)}
        assert remove_own_pidfile({}) is False  # not started by the launcher: a no-op
        os.rename(path, tmp_path / "moved.pid")
        path.write_text("1\n")  # another agent's pidfile now at the path
        assert remove_own_pidfile(env) is False and path.exists()
        os.unlink(path)
        os.rename(tmp_path / "moved.pid", path)
        assert remove_own_pidfile(env) is True and not path.exists()
    finally:
        os.close(fd)


def test_stop_refuses_a_process_that_is_not_our_agent(tmp_path):
    """A live pidfile holder whose cmdline is not `... --domain NAME` is left alone."""
    agents = tmp_path / "agents"
    agents.mkdir()
    launcher = DetachedLauncher([sys.executable, "-c", "import time; time.sleep(30)"], str(agents))
    result = launcher.start("other")
    assert result.action == "started"
    try:
        fake = DetachedLauncher(["/bin/true"], str(agents))
        # same pidfile, but ask to stop a different domain name written into it
        os.rename(agents / "other.pid", agents / "victim.pid")
        outcome = fake.stop("victim")
        assert (outcome.action, outcome.pid) == ("not-ours", result.pid)
        assert not pid_gone(result.pid)
    finally:
        os.kill(result.pid, signal.SIGKILL)
        wait_for(lambda: pid_gone(result.pid), what="sleeper exit")


def test_exec_failure_is_a_host_error_and_releases_the_lock(tmp_path):
    launcher = DetachedLauncher(["/nonexistent/agent"], str(tmp_path / "agents"))
    with pytest.raises(HostError, match="cannot run agent /nonexistent/agent: No such file or directory"):
        launcher.start("x")
    assert launcher.running("x") is None


def test_unwritable_agents_dir_is_a_host_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(HostError, match="cannot open pidfile"):
        DetachedLauncher(["/bin/true"], str(blocker / "agents")).start("x")


def test_start_for_a_new_run_stops_the_previous_runs_agent_and_its_successor_takes_over(host):
    """virsh destroy; virsh start in a row: the old run's agent still holds the lock when the new run starts."""
    config, config_path, markers = host
    launcher = make_launcher(config, config_path=config_path, systemd_dir="/nonexistent")
    first = launcher.start("web", 7)
    assert first.action == "started"
    started = markers / "web.started"
    wait_for(lambda: started.exists(), what="stand-in start")
    assert launcher.start("web", 7).action == "already-running"  # the same run: nothing to do
    second = launcher.start("web", 8)
    assert second.action == "started-after" and second.pid != first.pid
    wait_for(lambda: pid_gone(first.pid), what="the previous run's agent to exit")
    assert json.loads((markers / "web.stopped").read_text())["signal"] == "TERM"
    wait_for(lambda: launcher.running("web") == second.pid, what="the successor to take the lock")
    records = [json.loads(line) for line in started.read_text().splitlines()]
    assert [r["argv"][-4:] for r in records] == [["--domain-id", "7", "--domain", "web"],
                                                 ["--domain-id", "8", "--domain", "web"]]
    assert launcher.start("web", 8).action == "already-running"
    launcher.stop("web")
    wait_for(lambda: pid_gone(second.pid), what="agent exit")
    assert not (Path(config.agents_dir) / "web.pid").exists()
