"""Nothing of an agent stays once its domain is gone, also when the agent could not clean up (kill -9)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from vmcache.host.warmpool import WarmPool

libvirt = pytest.importorskip("libvirt")

from vmcache.host.files import file_stem  # noqa: E402

from tests.live.livelib import LiveEnv, nbd_dir, wait_for  # noqa: E402
from tests.live.test_reliability_live import cleanup, env, running  # noqa: E402,F401 - fixtures

pytestmark = pytest.mark.live

RUN_LOCKS = Path("/run/lock/vmcache")


def _files_of(env: LiveEnv, name: str, uuid: str) -> list[str]:
    """The agent's own files for domain ``name``: pidfile, status, targets file, run lock and gate, NBD dir."""
    stem = file_stem(name)
    paths = [env.agents / f"{stem}.pid", env.agents / f"{stem}.json", env.run / "prometheus" / f"{stem}.json",
             nbd_dir(env.run, name), *RUN_LOCKS.glob(f"{uuid}.*")]
    return sorted(str(p) for p in paths if p.exists())


def test_a_killed_agents_files_are_removed_when_its_domain_is_destroyed(env: LiveEnv, cleanup) -> None:
    """Found by hand: after kill -9 and a destroy, the targets file kept Prometheus scraping a dead agent."""
    name = "vmcache-test-left-kill9"
    dom = env.domain(name)
    pid, uuid = running(env, name)["pid"], dom.UUIDString()
    made = _files_of(env, name, uuid)
    assert any(p.endswith(".gate") for p in made) and any("prometheus" in p for p in made), made
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: env.agent_pid(name) is None, "the killed agent to be gone")
    assert _files_of(env, name, uuid) == made  # nobody cleaned up: its files are all there
    # what it would leave had it died restoring a saved set: its disk's ask of the host's warm-up budget
    WarmPool(str(env.run / "warmup.json"), 1 << 20, burst=1.0).take("0:0", f"/images/{name}.raw", 1 << 30, 0.5,
                                                                   owner=name)
    dom.destroy()
    try:
        wait_for(lambda: not _files_of(env, name, uuid), "the release hook to remove the dead agent's files",
                 timeout=10)
    except AssertionError as err:
        raise AssertionError(f"{err}: {_files_of(env, name, uuid)}\nhook log:\n{env.hook_log()[-2000:]}") from None
    assert "hook.swept domain=vmcache-test-left-kill9" in env.hook_log()
    for ledger in (env.run / "ledger.json", env.run / "share.json"):  # its reservation and demand too
        assert not ledger.exists() or f'"{name}"' not in ledger.read_text(), ledger.read_text()
    assert name not in (env.run / "warmup.json").read_text()


def test_a_live_agents_files_are_its_own_to_remove(env: LiveEnv, cleanup) -> None:
    """A destroy with the agent alive: the agent removes its files itself, and the hook sweeps nothing."""
    name = "vmcache-test-left-alive"
    dom = env.domain(name)
    uuid = dom.UUIDString()
    running(env, name)
    dom.destroy()
    wait_for(lambda: env.agent_pid(name) is None and not _files_of(env, name, uuid), "the agent to stop and clean up")
    assert "hook.swept domain=vmcache-test-left-alive" not in env.hook_log()
