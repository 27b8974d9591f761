"""What a launcher does and says: start or stop one domain's agent, and return at once.

The two ways (:mod:`vmcache.service.systemdunit`, :mod:`vmcache.service.detached`)
share this; :func:`vmcache.service.launcher.make_launcher` picks one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ..logfmt import event

__all__ = ["LaunchResult", "Launcher"]


@dataclass(frozen=True)
class LaunchResult:
    """What a start/stop did: ``action`` is one of started, already-running,
    start-requested, stopping, starting, not-running, stop-requested, not-ours."""

    action: str
    domain: str
    pid: int | None = None
    detail: str = ""

    def __str__(self) -> str:
        fields: dict[str, object] = {"domain": self.domain}
        if self.pid is not None:
            fields["pid"] = self.pid
        if self.detail:
            fields["detail"] = self.detail
        return event("agent." + self.action, **fields)


class Launcher(Protocol):
    def start(self, domain: str, domain_id: int | None = None) -> LaunchResult: ...
    def stop(self, domain: str) -> LaunchResult: ...
