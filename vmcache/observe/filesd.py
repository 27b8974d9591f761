"""Prometheus file_sd targets: one JSON file per agent, so one scrape job finds every agent.

Each agent writes ``/run/vmcache/prometheus/<domain>.json`` when its metrics
endpoint is up and removes it when it stops; a scrape job with::

    file_sd_configs:
      - files: [/run/vmcache/prometheus/*.json]

follows agents as they come and go (Prometheus watches the directory). The
file is replaced atomically (a hidden temporary file that the ``*.json``
glob does not match, then rename), so Prometheus never reads half of it.
/run is a tmpfs: files of agents that died with the host vanish on reboot.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import tempfile
from pathlib import Path

from ..errors import HostError
from ..logfmt import event

__all__ = ["DEFAULT_DIRECTORY", "TargetsFile", "safe_name", "targets_document"]

log = logging.getLogger(__name__)

DEFAULT_DIRECTORY = Path("/run/vmcache/prometheus")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def safe_name(domain: str) -> str:
    """A file name for ``domain``: itself when plain, else a cleaned form plus a short hash.

    Distinct domain names always give distinct file names (``a b`` and
    ``a_b`` differ by the hash); no result starts with a dot or contains
    a slash.
    """
    cleaned = _UNSAFE.sub("_", domain)[:100]
    if cleaned == domain and domain and not domain.startswith("."):
        return domain
    digest = hashlib.sha256(domain.encode()).hexdigest()[:8]
    return f"{cleaned.lstrip('.') or 'domain'}-{digest}"


def targets_document(target: str, labels: dict[str, str]) -> list[dict[str, object]]:
    """The file_sd document for one target (``host:port``) and its labels."""
    return [{"targets": [target], "labels": dict(labels)}]


class TargetsFile:
    """The targets file of one agent.

    ``directory`` defaults to /run/vmcache/prometheus (tests pass a
    temporary one). ``labels`` are added to ``domain`` and ``uuid``; all of
    them become target labels in Prometheus (so ``up`` says which
    domain's agent is down).
    """

    def __init__(
        self,
        domain: str,
        uuid: str,
        target: str,
        *,
        directory: Path | str = DEFAULT_DIRECTORY,
        labels: dict[str, str] | None = None,
    ) -> None:
        self.domain = domain
        self.uuid = uuid
        self.target = target
        self.directory = Path(directory)
        self.path = self.directory / f"{safe_name(domain)}.json"
        self.labels = {**(labels or {}), "domain": domain, "uuid": uuid}
        self._text = json.dumps(targets_document(target, self.labels), indent=2, ensure_ascii=False) + "\n"

    def write(self) -> Path:
        """Create or replace the file atomically; returns its path. Raises HostError."""
        try:
            self.directory.mkdir(mode=0o755, parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{self.path.name}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as out:
                    out.write(self._text)
                    out.flush()
                    os.fsync(out.fileno())
                os.chmod(tmp, 0o644)  # Prometheus may run as its own user
                os.replace(tmp, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as err:
            raise HostError(f"cannot write Prometheus targets file: {err.strerror}",
                            path=str(self.path), errno=err.errno) from err
        log.info(event("filesd.written", path=self.path, target=self.target))
        return self.path

    def remove(self) -> bool:
        """Delete the file if it is still ours (same content); True when it was deleted.

        A file rewritten meanwhile by another agent of the same domain (a
        restart that overlapped) is left alone. Raises HostError on an
        unexpected failure; a missing file is not one.
        """
        try:
            if self.path.read_text(encoding="utf-8") != self._text:
                log.info(event("filesd.not_ours", path=self.path))
                return False
            self.path.unlink()
        except FileNotFoundError:
            return False
        except OSError as err:
            raise HostError(f"cannot remove Prometheus targets file: {err.strerror}",
                            path=str(self.path), errno=err.errno) from err
        log.info(event("filesd.removed", path=self.path))
        return True

    def __enter__(self) -> TargetsFile:
        self.write()
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

