"""The host's copies of saved hot sets, one file per domain uuid, under /var/lib/vmcache/hotsets.

An agent saves its domain's hot set into the domain's XML, which carries it
through a live migration, ``virsh save``/``restore`` and a stop/start. A
fleet manager that defines the domain afresh (OpenStack Nova on a hard
reboot, a resize, an unshelve; oVirt at every start) drops it with the old
XML, and the next start would be cold. So every save also writes the same
element to ``<dir>/<uuid>.xml``, keyed by the domain's uuid (Nova's
instance uuid survives every redefinition), and the next agent warms from
whichever copy is newer (vmcache.service.hotsets). A copy is tied to its
image exactly as the XML's is (path, size, image id: a rebuilt instance's
new image does not match).

The directory is bounded: a copy not saved again within ``max_age`` is
removed, and of more than ``keep`` copies the oldest go; pruned at every
save. Files are root's alone (0600 in a 0700 directory): a hot set says
which parts of a guest's disk it uses.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable

from ..errors import ConfigError, HostError
from ..settings.hotset import MAX_TEXT, HotSet, build_hotset, parse_hotset
from .files import write_atomic

__all__ = ["HotStore"]

_UUID_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
_SUFFIX = ".xml"
#: A temporary file of write_atomic's left by a process killed mid-write is removed after this long.
_STALE_TEMP_SECONDS = 3600.0


class HotStore:
    """The copies in ``directory``: :meth:`save`, :meth:`load`, :meth:`remove` by domain uuid."""

    def __init__(self, directory: str, *, keep: int = 1000, max_age: float = 30 * 86400.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.directory = directory
        self.keep = keep
        self.max_age = max_age
        self._clock = clock

    def path(self, uuid: str) -> str:
        """The file of domain ``uuid``. Raises ConfigError for anything but a uuid (it becomes a file name)."""
        key = uuid.strip().lower()
        if not _UUID_RE.match(key):
            raise ConfigError("domain uuid", uuid, "not a uuid")
        return os.path.join(self.directory, key + _SUFFIX)

    def load(self, uuid: str) -> HotSet | None:
        """The copy of domain ``uuid``; None when there is none.

        Raises ConfigError when it is not a valid hot set (as the XML's is
        held to: vmcache.settings.hotset.parse_hotset), HostError when it
        cannot be read.
        """
        path = self.path(uuid)
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_TEXT + 1)
        except FileNotFoundError:
            return None
        except OSError as err:
            raise HostError(f"cannot read the host's hot set: {err.strerror}", path=path, errno=err.errno) from err
        return parse_hotset(raw)

    def save(self, uuid: str, hotset: HotSet) -> list[str]:
        """Replace the copy of domain ``uuid`` with ``hotset``, then prune; the files pruned. Raises HostError."""
        path = self.path(uuid)
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
        except OSError as err:
            raise HostError(f"cannot make the hot set directory: {err.strerror}", path=self.directory,
                            errno=err.errno) from err
        write_atomic(path, build_hotset(hotset), mode=0o600, what="the host's hot set")
        return self.prune(spare=path)

    def remove(self, uuid: str) -> bool:
        """Remove the copy of domain ``uuid``; False when there was none. Raises HostError."""
        path = self.path(uuid)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        except OSError as err:
            raise HostError(f"cannot remove the host's hot set: {err.strerror}", path=path, errno=err.errno) from err
        return True

    def prune(self, *, spare: str | None = None) -> list[str]:
        """Remove copies older than ``max_age`` and the oldest beyond ``keep`` (never ``spare``); the files removed.

        Never raises: a file that cannot be removed stays for the next prune.
        """
        now = self._clock()
        found: list[tuple[float, str]] = []
        try:
            names = os.listdir(self.directory)
        except OSError:
            return []
        for name in names:
            path = os.path.join(self.directory, name)
            try:
                mtime = os.lstat(path).st_mtime
            except OSError:
                continue
            if name.endswith(_SUFFIX) and _UUID_RE.match(name[:-len(_SUFFIX)]):
                found.append((mtime, path))
            elif name.startswith(".") and name.endswith(".tmp") and now - mtime > _STALE_TEMP_SECONDS:
                found.append((0.0, path))  # a write that never finished
        found.sort(reverse=True)  # newest first
        doomed = [p for i, (mtime, p) in enumerate(found)
                  if p != spare and (now - mtime > self.max_age or i >= self.keep)]
        removed = []
        for path in doomed:
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:
                pass
        return removed
