"""Stand-in for ``vmcache agent --host-config PATH --domain NAME`` in launcher and hook tests.

Run as ``python tests/standin_agent.py MARKER_DIR --host-config PATH --domain NAME``:
records in MARKER_DIR that it started (pid, argv), writes the agent status
file where the host config says, and waits for SIGTERM, which it records too.
It does what the launcher expects of the real agent and nothing else, so
tests of the hook keep meaning the same thing whatever the real agent does.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from vmcache.host.configfile import load_host_config
from vmcache.service.detached import remove_own_pidfile, wait_for_pidfile
from vmcache.host.files import file_stem
from vmcache.observe.status import AgentStatus, status_path, write_status

MAX_LIFETIME = 300.0  # never outlive a test run by long, even if nobody stops it


def kill_agents(agents_dir: str) -> list[int]:
    """Test cleanup: SIGKILL every agent holding a pidfile lock in ``agents_dir``; their pids."""
    from vmcache.host.files import lock_holder

    killed: list[int] = []
    try:
        names = [n for n in os.listdir(agents_dir) if n.endswith(".pid")]
    except FileNotFoundError:
        return killed
    for name in names:
        deadline = time.monotonic() + 5
        while (pid := lock_holder(os.path.join(agents_dir, name))) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)  # being started: it records its pid just before its exec
        if pid:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
    return killed


def main() -> int:
    stopped = False

    def on_term(signum: int, frame: object) -> None:
        nonlocal stopped
        stopped = True

    signal.signal(signal.SIGTERM, on_term)  # before the .started marker: a test may stop us right after it
    marker_dir = sys.argv[1]
    config_path = sys.argv[sys.argv.index("--host-config") + 1]
    domain = sys.argv[sys.argv.index("--domain") + 1]
    config = load_host_config(config_path, check_model=False)
    run = int(sys.argv[sys.argv.index("--domain-id") + 1]) if "--domain-id" in sys.argv else None
    wait_for_pidfile(domain, run)  # as the real agent: a successor takes the lock once the previous agent left
    stem = file_stem(domain)
    record = {"pid": os.getpid(), "argv": sys.argv, "ppid": os.getppid(), "sid": os.getsid(0)}
    with open(os.path.join(marker_dir, stem + ".started"), "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    path = status_path(config.agents_dir, domain)
    write_status(path, AgentStatus(domain=domain, pid=os.getpid(), state="running", started_at=time.time()))
    deadline = time.monotonic() + MAX_LIFETIME
    while not stopped and time.monotonic() < deadline:
        time.sleep(0.05)
    with open(os.path.join(marker_dir, stem + ".stopped"), "a", encoding="utf-8") as f:
        f.write(json.dumps({"pid": os.getpid(), "signal": "TERM" if stopped else "timeout"}) + "\n")
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    remove_own_pidfile()
    return 0


if __name__ == "__main__":
    sys.exit(main())
