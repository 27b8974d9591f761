"""The systemd launch path for real: a clean host with systemd as PID 1 (make test-host).

tests/host/inside.sh runs these inside the container that
tests/host/cleanhost.sh boots, after vmcache was installed there (``make
install``, later the Debian package). They use what is installed: the hook
in /etc/libvirt/hooks, the unit vmcache-agent@.service, the host config
/etc/vmcache/vmcache.yaml (runtime_dir /run/vmcache) - and the container's
own libvirtd, started by its units. Anywhere else they are skipped: they
need ``VMCACHE_CLEAN_HOST=1`` and systemd as PID 1.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ON_CLEAN_HOST = (os.environ.get("VMCACHE_CLEAN_HOST") == "1" and os.path.isdir("/run/systemd/system")
                 and Path("/proc/1/comm").read_text().strip() == "systemd")
pytestmark = [pytest.mark.live,
              pytest.mark.skipif(not ON_CLEAN_HOST, reason="only on the clean host of make test-host")]

if ON_CLEAN_HOST:
    from tests.live.livelib import (
        MiB,
        cache_metadata,
        connect,
        create_disk,
        destroy_domains,
        domain_xml,
        nbd_dir,
        read_status,
        scrape,
        start_paused,
        wait_for,
    )
    from tests.live.guestlib import guest_write, leftovers, read_until_pinned, write_until_pinned
    from vmcache.service.systemdunit import systemd_escape
    from vmcache.host.files import file_stem

PREFIX = "vmcache-host-"
RUN = Path("/run/vmcache")
AGENTS = RUN / "agents"
IMAGES = Path("/var/lib/libvirt/images/vmcache-host")
# Names libvirt accepts that need escaping in a unit name: spaces, quotes, unicode, a leading dash.
ODD = PREFIX + "sp ace 'q\"uote' ünï☃ -x"


def systemctl(*args: str) -> str:
    return subprocess.run(["systemctl", *args], capture_output=True, text=True, check=True, timeout=30).stdout


def unit_of(name: str) -> str:
    escaped = subprocess.run(["systemd-escape", "--", name], capture_output=True, text=True, check=True).stdout.strip()
    return f"vmcache-agent@{escaped}.service"


def show(unit: str) -> dict[str, str]:
    props = "Id,LoadState,ActiveState,SubState,Result,MainPID,NRestarts,ExecMainStatus,LimitMEMLOCK"
    return dict(line.partition("=")[::2] for line in systemctl("show", unit, "-p", props).splitlines())


def main_pid(unit: str) -> int:
    return int(show(unit)["MainPID"])


def journal(unit: str, since: float) -> str:
    """The unit's journal since ``since`` (time.time()): a unit name may have run before in this boot."""
    return subprocess.run(["journalctl", "-q", "--no-pager", "-o", "cat", "-u", unit, "--since", f"@{since:.0f}"],
                          capture_output=True, text=True, timeout=30).stdout


def memlock_can_be_unlimited() -> bool:
    """systemd raises RLIMIT_MEMLOCK to LimitMEMLOCK=infinity only with CAP_SYS_RESOURCE.

    This test machine's bounding set lacks it (systemd then sets the closest
    limit it can, silently); mlock still works through CAP_IPC_LOCK, which
    the VmLck checks below prove.
    """
    bounding = next(ln for ln in Path("/proc/1/status").read_text().splitlines() if ln.startswith("CapBnd:"))
    return bool(int(bounding.split()[1], 16) >> 24 & 1)


def vm_locked(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmLck:"):
            return int(line.split()[1]) * 1024
    return 0


def pinned(name: str) -> int:
    s = read_status(AGENTS, name)
    return s["disks"][0]["pinned_bytes"] if s and s.get("disks") else -1


@pytest.fixture
def conn() -> Iterator[Any]:
    import libvirt

    libvirt.registerErrorHandler(lambda _c, _e: None, None)
    c = connect()
    yield c
    destroy_domains(PREFIX)
    for dom_unit in systemctl("list-units", "--all", "--plain", "--no-legend", "vmcache-agent@*").splitlines():
        unit = dom_unit.split()[0]
        if "vmcache-host-" in unit:
            wait_for(lambda u=unit: show(u)["ActiveState"] in ("inactive", "failed"), f"{unit} to stop")
    c.close()


def start(conn: Any, name: str, budget: str = "16M") -> Any:
    IMAGES.mkdir(parents=True, exist_ok=True)
    disk = create_disk(IMAGES / f"{file_stem(name)}.raw", 64 * MiB)
    return start_paused(conn, domain_xml(name, disk, metadata=cache_metadata(budget)))


def agent_running(name: str) -> int:
    """Waits for the hook's unit to run the agent and the agent's first status; its pid."""
    unit = unit_of(name)
    wait_for(lambda: show(unit)["ActiveState"] == "active", f"the hook to start {unit}")
    pid = main_pid(unit)
    wait_for(lambda: (s := read_status(AGENTS, name)) and s["pid"] == pid and s["state"] == "running",
             f"the first status of {unit}")
    return pid


def assert_nothing_left(dom: Any | None, name: str) -> None:
    if dom is not None:
        left = leftovers(dom)
        assert left == {"bitmaps": [], "nodes": [], "exports": []}, left
    assert read_status(AGENTS, name) is None
    assert not nbd_dir(RUN, name).exists()
    assert not (AGENTS / f"{file_stem(name)}.pid").exists()
    for shared in (RUN / "ledger.json", RUN / "warmup.json"):
        assert not shared.exists() or name not in shared.read_text(), shared


# -- names ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["plain", "sp ace", "ünï☃", "a/b/c", "/lead", ".dot", "-dash", "back\\slash",
                                  "q'u\"ote", "tab\tnew", "x" * 200, ODD])
def test_unit_name_is_systemd_escape_and_maps_back(name: str) -> None:
    """vmcache's escaping is systemd-escape's; systemd loads the unit and %I gives the name back."""
    escaped = systemd_escape(name)
    assert f"vmcache-agent@{escaped}.service" == unit_of(name)
    back = subprocess.run(["systemd-escape", "-u", "--", escaped], capture_output=True, text=True, check=True).stdout
    assert back.removesuffix("\n") == name
    if len(f"vmcache-agent@{escaped}.service") <= 255:
        info = show(f"vmcache-agent@{escaped}.service")
        assert info["LoadState"] == "loaded", info


# -- the agent as a unit ----------------------------------------------------------------------


def test_hook_starts_the_unit_which_pins_with_unlimited_memlock_and_logs_to_the_journal(conn: Any) -> None:
    since = time.time() - 1
    dom = start(conn, ODD)
    pid = agent_running(ODD)
    unit = unit_of(ODD)
    # The unit's agent, for exactly this domain (%I: the name with its spaces, as one argument).
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]
    assert [a.decode() for a in argv[-2:]] == ["--domain", ODD], argv
    assert show(unit)["LimitMEMLOCK"] == "infinity"
    limits = Path(f"/proc/{pid}/limits").read_text()
    if memlock_can_be_unlimited():
        assert re.search(r"^Max locked memory\s+unlimited\s+unlimited", limits, re.M), limits
    write_until_pinned(dom, 0, 4 * MiB, lambda: pinned(ODD), "the agent to pin what the guest wrote")
    assert vm_locked(pid) >= 4 * MiB
    url = read_status(AGENTS, ODD)["metrics_url"]
    assert scrape(url, "vmcache_pinned_bytes") >= 4 * MiB
    # The agent's log is the unit's journal: found by the unit's (escaped) name, naming the domain.
    log = journal(unit, since)
    assert "disk.managed disk=vda" in log and ODD in log, log[-2000:]


def test_kill_9_systemd_restarts_the_agent_which_cleans_up_and_carries_on(conn: Any) -> None:
    name = PREFIX + "kill9"
    since = time.time() - 1
    dom = start(conn, name)
    old = agent_running(name)
    unit = unit_of(name)
    write_until_pinned(dom, 0, 4 * MiB, lambda: pinned(name))
    stale = leftovers(dom)["bitmaps"]
    assert stale
    os.kill(old, signal.SIGKILL)
    # Restart=on-failure, RestartSec=5s.
    wait_for(lambda: show(unit)["NRestarts"] == "1" and main_pid(unit) not in (0, old),
             "systemd to restart the killed agent", timeout=30)
    new = agent_running(name)
    assert new != old
    left = leftovers(dom)
    assert not set(stale) & set(left["bitmaps"]) and len(left["bitmaps"]) == 1 and left["exports"] == [], left
    guest_write(dom, 32 * MiB, 4 * MiB)
    read_until_pinned(dom, 32 * MiB, 4 * MiB, lambda: pinned(name), "the new agent to pin")
    wait_for(lambda: vm_locked(new) >= 4 * MiB, "the new agent to lock its pins")
    assert journal(unit, since).count("disk.managed disk=vda") == 2   # one per agent process


def test_kill_9_then_destroy_before_the_restart_leaves_nothing_behind(conn: Any) -> None:
    """The domain goes while systemd waits to restart its killed agent (RestartSec): the release stops the
    unit, so no agent comes back for a gone domain, and the hook removes what the dead one left."""
    name = PREFIX + "kill9-gone"
    dom = start(conn, name)
    uuid = dom.UUIDString()
    old = agent_running(name)
    unit = unit_of(name)
    write_until_pinned(dom, 0, 4 * MiB, lambda: pinned(name))
    assert list(Path("/run/lock/vmcache").glob(f"{uuid}.*"))
    assert (RUN / "prometheus" / f"{file_stem(name)}.json").exists()
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: not Path(f"/proc/{old}").exists() and main_pid(unit) == 0, "the killed agent to be gone")
    dom.destroy()
    wait_for(lambda: show(unit)["ActiveState"] in ("inactive", "failed"), f"the hook to stop {unit}")
    time.sleep(6)  # past RestartSec=5s: nothing restarts it
    info = show(unit)
    assert info["ActiveState"] in ("inactive", "failed") and main_pid(unit) == 0, info
    assert_nothing_left(None, name)
    assert not list(Path("/run/lock/vmcache").glob(f"{uuid}.*"))
    assert not (RUN / "prometheus" / f"{file_stem(name)}.json").exists()


def test_systemctl_stop_leaves_nothing_behind(conn: Any) -> None:
    name = PREFIX + "stop"
    since = time.time() - 1
    dom = start(conn, name)
    pid = agent_running(name)
    unit = unit_of(name)
    write_until_pinned(dom, 0, 4 * MiB, lambda: pinned(name))
    systemctl("stop", unit)
    info = show(unit)
    assert info["ActiveState"] == "inactive" and info["Result"] == "success", info
    assert not Path(f"/proc/{pid}").exists()
    assert dom.isActive()
    assert_nothing_left(dom, name)
    assert "agent.stopped" in journal(unit, since)


def test_domain_shutdown_stops_the_unit_and_leaves_nothing_behind(conn: Any) -> None:
    name = PREFIX + "down"
    dom = start(conn, name)
    pid = agent_running(name)
    unit = unit_of(name)
    write_until_pinned(dom, 0, 4 * MiB, lambda: pinned(name))
    dom.destroy()
    wait_for(lambda: show(unit)["ActiveState"] == "inactive", f"the hook to stop {unit}")
    info = show(unit)
    assert info["Result"] == "success" and info["NRestarts"] == "0", info
    assert not Path(f"/proc/{pid}").exists()
    assert_nothing_left(None, name)


# -- systemctl reload vmcache: a host rule added while the domain runs ------------------------------


def test_systemctl_reload_starts_the_agent_a_new_host_rule_wants_and_stops_it_when_the_rule_goes(conn: Any) -> None:
    """The operator's path for a fleet manager's domain (no vmcache metadata): edit the config, reload."""
    name = PREFIX + "rule"
    unit = unit_of(name)
    config = Path("/etc/vmcache/vmcache.yaml")
    kept = config.read_text()
    assert systemctl("is-enabled", "vmcache.service").strip() == "enabled"
    IMAGES.mkdir(parents=True, exist_ok=True)
    disk = create_disk(IMAGES / f"{file_stem(name)}.raw", 64 * MiB)
    start_paused(conn, domain_xml(name, disk))  # no metadata: the hook starts nothing
    time.sleep(2)
    assert show(unit)["ActiveState"] == "inactive"
    try:
        import yaml

        edited = yaml.safe_load(kept) or {}
        edited["domains"] = [{"match": {"name": f"{PREFIX}ru*"}, "budget": "8M"}]
        config.write_text(yaml.safe_dump(edited))
        systemctl("reload", "vmcache.service")
        pid = agent_running(name)
        status = read_status(AGENTS, name)
        assert status["managed_by"] == f"rule 1: name={PREFIX}ru*" and status["budget_bytes"] == 8 * MiB
        config.write_text(kept)
        systemctl("reload", "vmcache.service")
        wait_for(lambda: show(unit)["ActiveState"] == "inactive", f"reconcile to stop {unit}")
        assert not Path(f"/proc/{pid}").exists()
    finally:
        config.write_text(kept)
