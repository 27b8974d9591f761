"""The sweep at a domain's release: a killed agent's files go, a live agent's stay (real files and flocks)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from vmcache.host.files import file_stem, nbd_dir
from vmcache.service.leftovers import sweep
from vmcache.settings.config import HostConfig

UUID = "1b4e28ba-2fa1-11d2-883f-0016d3cca427"
OTHER = "00000000-2fa1-11d2-883f-0016d3cca427"


def _left_by_a_killed_agent(tmp_path: Path, domain: str = "web-1") -> tuple[HostConfig, Path, list[Path]]:
    """The files an agent of ``domain``'s run 7 leaves when SIGKILL ends it (and one of another domain)."""
    config = HostConfig(runtime_dir=str(tmp_path / "run"))
    locks = tmp_path / "lock"
    locks.mkdir()
    agents = Path(config.agents_dir)
    agents.mkdir(parents=True)
    nbd = Path(nbd_dir(config.runtime_dir, domain))
    nbd.mkdir(parents=True)
    targets = Path(config.runtime_dir, "prometheus")
    targets.mkdir()
    files = [agents / f"{file_stem(domain)}.pid", agents / f"{file_stem(domain)}.json",
             targets / f"{file_stem(domain)}.json", locks / f"{UUID}.7.lock", locks / f"{UUID}.7.gate",
             nbd / "nbd-0a1b2c3d.sock"]
    for path in files:
        path.write_text("4242\n")
    (locks / f"{OTHER}.2.lock").write_text("1\n")
    return config, locks, files


def test_a_killed_agents_files_are_removed_and_nothing_else(tmp_path):
    config, locks, files = _left_by_a_killed_agent(tmp_path)
    removed = sweep(config, "web-1", UUID, lock_dir=str(locks))
    assert not [p for p in files if p.exists()]
    assert not Path(nbd_dir(config.runtime_dir, "web-1")).exists()
    assert sorted(removed) == sorted([*map(str, files), nbd_dir(config.runtime_dir, "web-1")])
    assert (locks / f"{OTHER}.2.lock").exists()  # another domain's run
    assert sweep(config, "web-1", UUID, lock_dir=str(locks)) == []  # nothing left: nothing to say


def _held(path: Path) -> int:
    fd = os.open(path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another open file description: what a live agent holds
    return fd


def test_nothing_is_touched_while_the_agent_holds_its_pidfile(tmp_path):
    config, locks, files = _left_by_a_killed_agent(tmp_path)
    fd = _held(files[0])
    try:
        assert sweep(config, "web-1", UUID, lock_dir=str(locks)) == []
    finally:
        os.close(fd)
    assert all(p.exists() for p in files)


def test_nothing_is_touched_while_an_agent_holds_a_run_lock(tmp_path):
    """Under systemd there is no pidfile: the run lock is what a live agent holds."""
    config, locks, files = _left_by_a_killed_agent(tmp_path)
    files[0].unlink()
    fd = _held(locks / f"{UUID}.7.lock")
    try:
        assert sweep(config, "web-1", UUID, lock_dir=str(locks)) == []
    finally:
        os.close(fd)
    assert all(p.exists() for p in files[1:])


def test_without_a_uuid_the_run_files_stay_and_the_rest_goes(tmp_path):
    config, locks, files = _left_by_a_killed_agent(tmp_path)
    sweep(config, "web-1", None, lock_dir=str(locks))
    assert (locks / f"{UUID}.7.lock").exists() and (locks / f"{UUID}.7.gate").exists()
    assert not files[1].exists() and not files[2].exists()


def test_nothing_there_is_nothing_removed(tmp_path):
    config = HostConfig(runtime_dir=str(tmp_path / "run"))
    assert sweep(config, "web-1", UUID, lock_dir=str(tmp_path / "none")) == []
    assert not (tmp_path / "run").exists()  # and nothing made


def test_a_killed_agents_ledger_entries_go_and_a_live_agents_stay(tmp_path):
    """Found on the clean host: with no other agent to divide the cap, a killed agent's reservation stayed."""
    import json

    config, locks, _ = _left_by_a_killed_agent(tmp_path)
    live = {"pid": os.getpid(), "pid_start_time": None, "bytes": 1 << 20}
    dead = {"pid": 2 ** 22 + 17, "pid_start_time": 1, "bytes": 64 << 20}  # past pid_max: no such process
    ledger, share = Path(config.ledger_path), Path(config.runtime_dir, "share.json")
    ledger.write_text(json.dumps({"domains": {"web-1": dead, "db-2": live}}))
    share.write_text(json.dumps({"version": 1, "cap": None, "domains": {
        "web-1": {**dead, "budget": 1 << 30, "minimum": 0, "granted": 0, "curve": [[1 << 20, 1.0]]},
        "db-2": {**live, "budget": 1 << 30, "minimum": 0, "granted": 0, "curve": [[1 << 20, 1.0]]}}}))
    removed = sweep(config, "web-1", UUID, lock_dir=str(locks))
    assert f"{ledger}:web-1" in removed and f"{share}:web-1" in removed
    assert list(json.loads(ledger.read_text())["domains"]) == ["db-2"]
    assert list(json.loads(share.read_text())["domains"]) == ["db-2"]
    assert sweep(config, "web-1", UUID, lock_dir=str(locks)) == []


def test_a_damaged_ledger_is_left_to_the_agents(tmp_path):
    config, locks, files = _left_by_a_killed_agent(tmp_path)
    Path(config.ledger_path).write_text("{not json")
    removed = sweep(config, "web-1", UUID, lock_dir=str(locks))
    assert sorted(removed) == sorted([*map(str, files), nbd_dir(config.runtime_dir, "web-1")])
    assert Path(config.ledger_path).read_text() == "{not json"
