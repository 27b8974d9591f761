"""The run gate: a command of an old run's agent and the hook's prepare of the next run exclude each other.

Real files and real ``flock`` in a temporary directory; the "command in
flight" is a thread holding the gate; the stuck holder is a real child
process that holds it until killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from vmcache.errors import MonitorRunOverError
from vmcache.host.rungate import RunGate, fence_runs, uuid_of

UUID = "5f1d2c3b-0a9e-4e7d-8c6b-1a2b3c4d5e6f"


def test_a_fenced_run_sends_nothing_and_an_unfenced_one_sends(tmp_path: Path) -> None:
    gate = RunGate(str(tmp_path))
    gate.open(UUID, 7)
    with gate.hold():
        pass
    other = RunGate(str(tmp_path))
    other.open("another-domain", 3)
    fenced = fence_runs(str(tmp_path), UUID)
    assert (fenced.gates, fenced.killed) == (1, ())
    # the run is over, as when the domain stopped: the agent ends quietly, its worker records no read failure
    with pytest.raises(MonitorRunOverError, match="fenced"), gate.hold():
        pytest.fail("a command of a fenced run was let through")
    with other.hold():  # another domain's run is not touched
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["another-domain.3.gate"]


def test_the_fence_waits_for_the_command_in_flight(tmp_path: Path) -> None:
    gate = RunGate(str(tmp_path))
    gate.open(UUID, 7)
    held, done = threading.Event(), []

    def command() -> None:
        with gate.hold():
            held.set()
            time.sleep(0.3)
            done.append(time.monotonic())

    sender = threading.Thread(target=command)
    sender.start()
    held.wait(5)
    fenced = fence_runs(str(tmp_path), UUID)
    returned = time.monotonic()
    sender.join()
    assert done and done[0] <= returned, "prepare returned while a command of the old run was in flight"
    assert fenced.killed == ()
    with pytest.raises(MonitorRunOverError), gate.hold():
        pass


def test_a_command_that_opened_the_gate_before_the_fence_and_locks_after_is_not_sent(tmp_path: Path) -> None:
    gate = RunGate(str(tmp_path))
    gate.open(UUID, 7)
    stale = os.open(gate.path or "", os.O_RDONLY)  # what hold() opened just before the hook renamed the gate
    try:
        fence_runs(str(tmp_path), UUID)
        from vmcache.host.files import names_fd

        assert not names_fd(gate.path or "", stale)  # hold() checks this after its flock
    finally:
        os.close(stale)


def test_a_holder_stuck_past_the_wait_is_killed_and_the_start_goes_on(tmp_path: Path) -> None:
    gate_dir = str(tmp_path)
    code = (f"import sys, time; sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r});"
            f"from vmcache.host.rungate import RunGate; g = RunGate({gate_dir!r}); g.open({UUID!r}, 9);"
            "h = g.hold(); h.__enter__(); print('held', flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code, "agent", "--domain", "d"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "held\n"
        fenced = fence_runs(gate_dir, UUID, wait=0.2)
        assert fenced.killed == (child.pid,)
        assert child.wait(10) == -signal.SIGKILL
        assert list(tmp_path.iterdir()) == []
    finally:
        child.kill()
        child.wait()


def test_the_kill_spares_a_process_that_is_not_an_agent(tmp_path: Path) -> None:
    (tmp_path / f"{UUID}.4.gate").write_text(f"{os.getpid()}\n")  # a pid now naming pytest, not an agent
    with open(tmp_path / f"{UUID}.4.gate") as f:
        import fcntl

        fcntl.flock(f, fcntl.LOCK_SH)
        fenced = fence_runs(str(tmp_path), UUID, wait=0.05)
    assert fenced.killed == (os.getpid(),)  # named, but the pytest process lives on
    assert not (tmp_path / f"{UUID}.4.fenced").exists()


def test_the_agent_removes_its_gate_and_a_fence_without_gates_is_one_listdir(tmp_path: Path) -> None:
    gate = RunGate(str(tmp_path))
    gate.open(UUID, 7)
    gate.remove()
    gate.remove()
    assert list(tmp_path.iterdir()) == []
    assert fence_runs(str(tmp_path), UUID).gates == 0
    assert fence_runs(str(tmp_path / "absent"), UUID).gates == 0
    with RunGate(str(tmp_path)).hold():  # never opened (no run id): no gate to hold
        pass


def test_uuid_of_reads_the_domains_uuid_not_a_later_one() -> None:
    xml = (f"<domain type='kvm' id='4'><name>d</name><uuid>{UUID.upper()}</uuid>"
           "<metadata><x:y xmlns:x='urn:x'><uuid>00000000-0000-0000-0000-000000000000</uuid></x:y></metadata>"
           "</domain>").encode()
    assert uuid_of(xml) == UUID
    assert uuid_of(b"<domain><name>d</name></domain>") is None
