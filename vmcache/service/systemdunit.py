"""Start and stop agents as instances of systemd's vmcache-agent@ template unit.

Where ``/run/systemd/system`` exists: ``systemctl --no-block start
vmcache-agent@<escaped name>.service``; the unit
(hooks/vmcache-agent@.service) sets ``LimitMEMLOCK=infinity`` and restarts
the agent on failure. Used by the libvirt hook: imports nothing heavy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import HostError
from .launchresult import LaunchResult

if TYPE_CHECKING:
    import subprocess

__all__ = ["SystemdLauncher", "systemd_escape", "UNIT_TEMPLATE", "SYSTEMD_RUN_DIR"]

SYSTEMD_RUN_DIR = "/run/systemd/system"
UNIT_TEMPLATE = "vmcache-agent@{}.service"
SYSTEMCTL_TIMEOUT = 10.0


def systemd_escape(name: str) -> str:
    """The unit-name escaping of ``systemd-escape NAME`` (``/`` -> ``-``, others ``\\xNN``)."""
    out = []
    for i, ch in enumerate(name):
        if ch == "/":
            out.append("-")
        elif (ch.isascii() and (ch.isalnum() or ch in ":_.")) and not (i == 0 and ch == "."):
            out.append(ch)
        else:
            out.extend(f"\\x{b:02x}" for b in ch.encode("utf-8", "surrogatepass"))
    return "".join(out)


class SystemdLauncher:
    """Starts agents as instances of the vmcache-agent@ template unit."""

    def __init__(self, *, systemctl: str = "systemctl",
                 run: Callable[..., subprocess.CompletedProcess[Any]] | None = None) -> None:
        self.systemctl = systemctl
        self._run = run

    def unit(self, domain: str) -> str:
        return UNIT_TEMPLATE.format(systemd_escape(domain))

    def _systemctl(self, verb: str, domain: str) -> None:
        import subprocess  # only on this path: the hook's start-up time counts

        argv = [self.systemctl, "--no-block", verb, self.unit(domain)]
        run = self._run or subprocess.run
        try:
            done = run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             timeout=SYSTEMCTL_TIMEOUT, check=False)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise HostError(f"systemctl {verb} {self.unit(domain)}: {err}") from err
        if done.returncode != 0:
            message = (done.stderr or b"").decode("utf-8", "replace").strip().splitlines()
            raise HostError(f"systemctl {verb} {self.unit(domain)} failed ({done.returncode}): "
                            + (message[-1] if message else "no message"))

    def start(self, domain: str, domain_id: int | None = None) -> LaunchResult:
        """Ask systemd to start the unit (no-op if active). Raises HostError.

        The unit's agent binds to the run it finds (an instance name cannot
        carry ``domain_id``); systemd starts it only after a stopping
        instance has exited.
        """
        self._systemctl("start", domain)
        return LaunchResult("start-requested", domain, detail=self.unit(domain))

    def stop(self, domain: str) -> LaunchResult:
        """Ask systemd to stop the unit. Raises HostError."""
        self._systemctl("stop", domain)
        return LaunchResult("stop-requested", domain, detail=self.unit(domain))
