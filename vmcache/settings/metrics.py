"""The ``metrics`` section of the host config: where agents serve Prometheus metrics, and how (pure).

Part of vmcache.settings.config's parse (its ``metrics.*`` keys); the
exporter (vmcache.observe.exporter) takes these to serve HTTP(S).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .yamltext import abs_path, no_unknown
from .yamltext import section as mapping_section

__all__ = ["MetricsTLS", "MetricsBasicAuth", "MetricsConfig", "parse_metrics", "metrics_from_json"]


@dataclass(frozen=True)
class MetricsTLS:
    """HTTPS for the metrics endpoint (vmcache.observe.exporter.tls_context makes the SSL context)."""

    certfile: str
    keyfile: str
    client_cafile: str | None = None
    client_auth_required: bool = False


@dataclass(frozen=True)
class MetricsBasicAuth:
    """HTTP basic auth: user name and a file holding the password (read by exporter.basic_auth_credentials)."""

    username: str
    password_file: str


@dataclass(frozen=True)
class MetricsConfig:
    """Where agents serve Prometheus metrics: each agent takes the first free port of the range."""

    listen: str = "127.0.0.1"
    port_first: int = 9850
    port_last: int = 9999
    tls: MetricsTLS | None = None
    basic_auth: MetricsBasicAuth | None = None

    @property
    def ports(self) -> range:
        return range(self.port_first, self.port_last + 1)


_METRICS_KEYS = ("listen", "ports", "tls", "basic_auth")
_TLS_KEYS = ("certfile", "keyfile", "client_cafile", "client_auth_required")
_AUTH_KEYS = ("username", "password_file")


def _optional_path(value: object, key: str) -> str | None:
    return None if value is None else abs_path(value, key)


def _ports(value: object) -> tuple[int, int]:
    key = "metrics.ports"
    if isinstance(value, bool):
        raise ConfigError(key, value, "must be a port or a range such as 9850-9999")
    if isinstance(value, int):
        first = last = value
    elif isinstance(value, str) and re.fullmatch(r"\s*[0-9]{1,5}\s*-\s*[0-9]{1,5}\s*", value):
        first, last = (int(p) for p in value.split("-"))
    elif (isinstance(value, list) and len(value) == 2
          and all(isinstance(p, int) and not isinstance(p, bool) for p in value)):
        first, last = value
    else:
        raise ConfigError(key, value, "must be a port or a range such as 9850-9999")
    if not 1 <= first <= last <= 65535:
        raise ConfigError(key, value, "ports must be in 1-65535, first <= last")
    return first, last


def parse_metrics(value: object) -> MetricsConfig:
    """The ``metrics`` section; ConfigError naming the dotted key."""
    section = mapping_section(value, "metrics")
    no_unknown(section, _METRICS_KEYS, "metrics.")
    values: dict[str, Any] = {}
    if "listen" in section:
        import ipaddress  # here: the hook loads this module on every domain start

        listen = section["listen"]
        try:
            values["listen"] = str(ipaddress.ip_address(listen if isinstance(listen, str) else ""))
        except ValueError:
            raise ConfigError("metrics.listen", listen, "must be an IP address, e.g. 127.0.0.1 or ::1") from None
    if "ports" in section:
        values["port_first"], values["port_last"] = _ports(section["ports"])
    if section.get("tls") is not None:
        values["tls"] = _tls(mapping_section(section["tls"], "metrics.tls"))
    if section.get("basic_auth") is not None:
        auth = mapping_section(section["basic_auth"], "metrics.basic_auth")
        no_unknown(auth, _AUTH_KEYS, "metrics.basic_auth.")
        username = auth.get("username")
        if not isinstance(username, str) or not username or ":" in username or not username.isprintable():
            raise ConfigError("metrics.basic_auth.username", username, "must be a non-empty name without ':'")
        values["basic_auth"] = MetricsBasicAuth(
            username, abs_path(auth.get("password_file"), "metrics.basic_auth.password_file"))
    return MetricsConfig(**values)


def _tls(section: Mapping[Any, Any]) -> MetricsTLS:
    no_unknown(section, _TLS_KEYS, "metrics.tls.")
    required = section.get("client_auth_required", False)
    if not isinstance(required, bool):
        raise ConfigError("metrics.tls.client_auth_required", required, "must be true or false")
    cafile = _optional_path(section.get("client_cafile"), "metrics.tls.client_cafile")
    if required and cafile is None:
        raise ConfigError("metrics.tls.client_auth_required", required, "needs client_cafile")
    return MetricsTLS(
        certfile=abs_path(section.get("certfile"), "metrics.tls.certfile"),
        keyfile=abs_path(section.get("keyfile"), "metrics.tls.keyfile"),
        client_cafile=cafile,
        client_auth_required=required,
    )


def metrics_from_json(data: dict[str, Any]) -> MetricsConfig:
    """The inverse of vmcache.settings.config.config_to_json for this section (KeyError/TypeError if odd)."""
    values = dict(data)
    if values["tls"] is not None:
        values["tls"] = MetricsTLS(**values["tls"])
    if values["basic_auth"] is not None:
        values["basic_auth"] = MetricsBasicAuth(**values["basic_auth"])
    return MetricsConfig(**values)
