"""Fixtures shared by the live test modules (the plumbing itself is in livelib.py)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def libvirt_host() -> None:
    """Skips unless this is root and libvirtd answers on qemu:///system; silences libvirt's stderr."""
    libvirt = pytest.importorskip("libvirt")
    from tests.live import livelib

    if os.geteuid() != 0:
        pytest.skip("needs root (libvirt hooks live in /etc/libvirt/hooks)")
    libvirt.registerErrorHandler(lambda _c, _e: None, None)
    conn = livelib.open_conn()
    if conn is None:
        pytest.skip("libvirtd does not answer on qemu:///system (scripts/libvirtd.sh starts it)")
    conn.close()


@pytest.fixture(scope="module")
def live_tmp(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Path]:
    """A temporary directory for a module's host config, images and runtime files, readable by QEMU; removed after."""
    tmp = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_"))
    tmp.chmod(0o755)
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def hooked(libvirt_host: None, live_tmp: Path) -> Iterator[object]:
    """``hooked(config, prefix, agents)``: the test hook installed for host config ``config`` until the module ends.

    At the end: every domain named ``prefix...`` destroyed, every agent with
    a pidfile in ``agents`` stopped, then the hook removed and what was
    there put back (hooklib.installed_hook). Returns install.sh's output.
    Depends on ``live_tmp`` so that directory outlives the agents.
    """
    from contextlib import ExitStack

    from tests.live import hooklib, livelib

    with ExitStack() as stack:

        def install(config: Path, prefix: str, agents: Path) -> str:
            out = stack.enter_context(hooklib.installed_hook(config))
            stack.callback(livelib.stop_agents, agents)
            stack.callback(livelib.destroy_domains, prefix)
            return out

        yield install


LOG_TAIL = 40  # lines of each agent log a failure report carries


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    """A failed live test's report carries the tails of the three logs last written in its module's log
    directory (agents' and the hook's): they go with that directory, and a CI run leaves nothing else to read."""
    outcome = yield
    report = outcome.get_result()
    env = getattr(item, "funcargs", {}).get("env")
    logs = getattr(env, "logs", None)
    if not report.failed or not isinstance(logs, Path) or not logs.is_dir():
        return
    newest = sorted(logs.glob("*.log"), key=lambda p: p.stat().st_mtime)[-3:]
    for path in newest:
        lines = path.read_text(errors="replace").splitlines()[-LOG_TAIL:]
        report.sections.append((f"log {path.name} (last {len(lines)} lines)", "\n".join(lines)))
