"""How agents are started: the launcher for this host, systemd where it runs, detached processes otherwise.

- **systemd** (``/run/systemd/system`` exists): :mod:`vmcache.service.systemdunit`;
- **detached** (no systemd): :mod:`vmcache.service.detached` (flock'd pidfiles, successors).

Both start or stop one domain's agent and return at once
(:class:`~vmcache.service.launchresult.LaunchResult`). Used by the libvirt
hook: imports nothing heavy, never calls libvirt.
"""

from __future__ import annotations

import os
import sys

from ..settings.config import DEFAULT_PATH, HostConfig
from .detached import DetachedLauncher
from .launchresult import Launcher
from .systemdunit import SYSTEMD_RUN_DIR, SystemdLauncher

__all__ = ["make_launcher", "default_agent_command"]


def default_agent_command(python: str = sys.executable) -> tuple[str, ...]:
    """``<python> -m vmcache.cli agent``: the agent of the vmcache that runs this code."""
    return (python, "-m", "vmcache.cli", "agent")


def make_launcher(config: HostConfig, *, config_path: str = DEFAULT_PATH, systemd_dir: str = SYSTEMD_RUN_DIR,
                  python: str = sys.executable) -> Launcher:
    """The launcher for this host: systemd where it runs, detached processes otherwise.

    A detached agent runs ``<agent_command> --host-config CONFIG_PATH --domain NAME``
    (agent_command defaults to this Python's ``-m vmcache.cli agent``).
    """
    if os.path.isdir(systemd_dir):
        return SystemdLauncher()
    command = (*(config.agent_command or default_agent_command(python)), "--host-config", config_path)
    return DetachedLauncher(command, config.agents_dir, log_dir=config.log_dir)
