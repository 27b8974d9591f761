"""Prometheus file_sd targets: one JSON file per agent, so one scrape job finds every agent.

Each agent writes ``/run/vmcache/prometheus/<stem>.json`` (``file_stem`` of the
domain name, as for its status file) when its metrics
endpoint is up and removes it when it stops; a scrape job with::

    file_sd_configs:
      - files: [/run/vmcache/prometheus/*.json]

follows agents as they come and go (Prometheus watches the directory). The
file is replaced atomically (a hidden temporary file that the ``*.json``
glob does not match, then rename), so Prometheus never reads half of it.
/run is a tmpfs: files of agents that died with the host vanish on reboot.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ..errors import HostError
from ..host.files import file_stem, write_atomic
from ..logfmt import event

__all__ = ["DEFAULT_DIRECTORY", "TargetsFile", "targets_document", "targets_path"]

log = logging.getLogger(__name__)

DEFAULT_DIRECTORY = Path("/run/vmcache/prometheus")


def targets_path(directory: Path | str, domain: str) -> Path:
    """Where the agent of ``domain`` keeps its targets file in ``directory``."""
    return Path(directory) / f"{file_stem(domain)}.json"


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
        self.path = targets_path(self.directory, domain)
        self.labels = {**(labels or {}), "domain": domain, "uuid": uuid}
        self._text = json.dumps(targets_document(target, self.labels), indent=2, ensure_ascii=False) + "\n"

    def write(self) -> Path:
        """Create or replace the file atomically; returns its path. Raises HostError."""
        # 0644: Prometheus may run as its own user
        write_atomic(self.path, self._text, make_dirs=True, what="Prometheus targets file")
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

