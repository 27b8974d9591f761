"""A running agent's eye on the host config file: a changed, valid config is handed over once.

The agent reads the config once, at start. An operator who edits it - adds
a host rule, fixes a broken file - expects the running agents to follow:
each cycle the agent stats the file (one system call), and when it changed
loads it again. A config that does not load is one warning line, and the
agent goes on with the one it has.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..errors import ConfigError
from ..host.configfile import config_identity, load_host_config
from ..logfmt import event
from ..settings.config import HostConfig

__all__ = ["ConfigWatch"]


class ConfigWatch:
    """The config file at ``path``, as it was when the watch was made; :meth:`poll` each cycle."""

    def __init__(self, path: str, *, logger: logging.Logger,
                 load: Callable[[str], HostConfig] = load_host_config,
                 identity: Callable[[str], list[int] | None] = config_identity) -> None:
        self.path = path
        self._log = logger
        self._load = load
        self._identity = identity
        self._seen = identity(path)

    def poll(self) -> HostConfig | None:
        """The config anew if the file changed since the last poll and is valid; else None."""
        seen = self._identity(self.path)
        if seen == self._seen:
            return None
        self._seen = seen
        try:
            config = self._load(self.path)
        except ConfigError as err:
            self._log.warning(event("config.unusable", path=self.path, error=err, using="the config read before"))
            return None
        self._log.info(event("config.changed", path=self.path))
        return config
