"""An agent's observability: its metrics registry, the HTTP server and its file_sd targets file.

Observability never changes what is pinned: when the server cannot start,
the agent pins without it.
"""

from __future__ import annotations

from collections.abc import Callable

from .. import __version__
from ..observe.exporter import MetricsServer, serve_metrics
from ..observe.filesd import TargetsFile
from ..observe.heatmap import HeatmapData, RenderOptions, heatmap_page
from ..observe.metrics import AgentMetrics
from ..settings.config import HostConfig

__all__ = ["Telemetry"]


class Telemetry:
    """Metrics of one domain's agent, served over HTTP with its heat maps once :meth:`start` ran."""

    def __init__(self, domain: str, config: HostConfig) -> None:
        self.domain = domain
        self._config = config
        self._metrics: AgentMetrics | None = None
        self._server: MetricsServer | None = None
        self._targets: TargetsFile | None = None

    def metrics(self, uuid: str) -> AgentMetrics:
        """The agent's metrics (made on first use, labelled with the domain's ``uuid``)."""
        if self._metrics is None:
            self._metrics = AgentMetrics(self.domain, uuid, version=__version__)
        return self._metrics

    def start(self, uuid: str, heatmaps: Callable[[str], HeatmapData | None]) -> str:
        """Serve /metrics and /heatmap/<disk>.png|json, write the targets file; the URL.

        Raises VmcacheError when no port can be bound or a TLS/auth file cannot be read.
        """
        metrics = self.metrics(uuid)
        m = self._config.metrics
        options = RenderOptions(blocks_per_pixel=self._config.heatmap.blocks_per_pixel,
                                aspect=self._config.heatmap.aspect)
        self._server = serve_metrics(metrics.registry, address=m.listen, ports=m.ports, tls=m.tls,
                                     basic_auth=m.basic_auth,
                                     pages=lambda path: heatmap_page(path, heatmaps, options))
        self._targets = TargetsFile(self.domain, uuid, self._server.target,
                                    directory=self._config.targets_dir)
        self._targets.write()
        return self._server.url

    def set_host_memory(self, available_bytes: int) -> None:
        """Record the host's MemAvailable (nothing before the metrics exist)."""
        if self._metrics is not None:
            self._metrics.set_host_memory(available_bytes)

    def set_read_signal(self, signal: str) -> None:
        """Record which signal of the guest's reads the agent uses (nothing before the metrics exist)."""
        if self._metrics is not None:
            self._metrics.set_read_signal(signal)

    def set_share(self, budget: int, granted: int, demand: int, minimum: int, cap: int | None) -> None:
        """Record the domain's budget, grant, demand and minimum, and the host cap.

        Nothing before the metrics exist.
        """
        if self._metrics is not None:
            self._metrics.set_share(budget=budget, granted=granted, demand=demand, minimum=minimum, cap=cap)

    def close(self) -> None:
        """Remove the targets file, stop the server."""
        try:
            if self._targets is not None:
                self._targets.remove()
        finally:
            if self._server is not None:
                self._server.close()
