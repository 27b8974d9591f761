"""Serve a Prometheus registry over HTTP(S): first free port of a range, optional TLS and basic auth.

prometheus_client's ``start_http_server`` takes one port and no
authentication, so this module builds the same server from the library's
public parts (``make_wsgi_app``, ``ThreadingWSGIServer``) and keeps its TLS
option names (``certfile``, ``keyfile``, ``client_cafile``,
``client_auth_required``: vmcache.settings.config.MetricsTLS, as operators
write them in the host config; TLS 1.2 at least). Two
differences, both on purpose: the TLS handshake runs in the request's
thread with a timeout (a client that connects and says nothing cannot stall
every scrape), and basic auth is a small WSGI wrapper comparing in constant
time against a password read from a file (never logged).

A port is taken by binding it, not by probing it first: two agents
starting at once cannot both get the same one.
"""

from __future__ import annotations

import base64
import binascii
import errno
import hashlib
import hmac
import ipaddress
import logging
import socket
import ssl
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from ..errors import ConfigError, HostError
from ..settings.metrics import MetricsBasicAuth, MetricsTLS
from ..logfmt import event

__all__ = [
    "DEFAULT_ADDRESS",
    "DEFAULT_PORTS",
    "basic_auth_credentials",
    "tls_context",
    "MetricsServer",
    "serve_metrics",
]

log = logging.getLogger(__name__)

DEFAULT_ADDRESS = "127.0.0.1"
#: One port per agent (per domain) on a host; the first free one wins.
DEFAULT_PORTS = range(9850, 10000)
#: Seconds a client may take for the TLS handshake or to send its request.
CLIENT_TIMEOUT = 10.0
LISTEN_BACKLOG = 1024
WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


TLS_MIN_VERSION = ssl.TLSVersion.TLSv1_2


def tls_context(tls: MetricsTLS) -> ssl.SSLContext:
    """The server-side SSL context for ``tls``; ConfigError when a file cannot be loaded.

    ``client_cafile`` with ``client_auth_required`` asks Prometheus for a
    client certificate (mutual TLS).
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = TLS_MIN_VERSION
    try:
        ctx.load_cert_chain(certfile=tls.certfile, keyfile=tls.keyfile)
    except (OSError, ssl.SSLError) as err:
        raise ConfigError("metrics.tls.certfile", tls.certfile,
                          f"cannot load certificate and key {tls.keyfile!r}: {err}") from err
    if tls.client_cafile:
        try:
            ctx.load_verify_locations(tls.client_cafile)
        except (OSError, ssl.SSLError) as err:
            raise ConfigError("metrics.tls.client_cafile", tls.client_cafile,
                              f"cannot load client CA: {err}") from err
    if tls.client_auth_required:
        if not tls.client_cafile:
            raise ConfigError("metrics.tls.client_auth_required", True, "needs client_cafile")
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def basic_auth_credentials(auth: MetricsBasicAuth) -> bytes:
    """``username:password`` as a client sends it; ConfigError when unusable.

    The password file is read now (one line; a trailing newline is not part
    of the password). The password is never logged or shown.
    """
    if not auth.username or ":" in auth.username:
        raise ConfigError("metrics.basic_auth.username", auth.username, "must be non-empty, without ':'")
    try:
        raw = Path(auth.password_file).read_bytes()
    except OSError as err:
        raise ConfigError("metrics.basic_auth.password_file", auth.password_file,
                          f"cannot read: {err.strerror}") from err
    password = raw.removesuffix(b"\n").removesuffix(b"\r")
    if not password or b"\n" in password:
        raise ConfigError("metrics.basic_auth.password_file", auth.password_file,
                          "must hold one non-empty line")
    return auth.username.encode() + b":" + password


def _require_basic_auth(app: WSGIApp, credentials: bytes, realm: str = "vmcache") -> WSGIApp:
    """Wrap ``app`` so only requests carrying ``credentials`` reach it."""
    expected = hashlib.sha256(credentials).digest()  # equal lengths: compare_digest leaks nothing
    challenge = [("WWW-Authenticate", f'Basic realm="{realm}", charset="UTF-8"'),
                 ("Content-Type", "text/plain; charset=utf-8")]

    def authenticated(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        scheme, _, token = environ.get("HTTP_AUTHORIZATION", "").partition(" ")
        given = b""
        if scheme.lower() == "basic":
            try:
                given = base64.b64decode(token.strip(), validate=True)
            except (binascii.Error, ValueError):
                given = b""
        if given and hmac.compare_digest(hashlib.sha256(given).digest(), expected):
            return app(environ, start_response)
        start_response("401 Unauthorized", challenge)
        return [b"401 Unauthorized\n"]

    return authenticated


class _Handler(WSGIRequestHandler):
    timeout = CLIENT_TIMEOUT

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        """No access log: Prometheus scrapes every few seconds."""


class _Server(ThreadingWSGIServer):
    """prometheus_client's threading server, with the TLS handshake in the request thread."""

    ssl_context: ssl.SSLContext | None = None
    # listen(2) backlog (socketserver's default is 5): a burst of clients waits instead of being reset.
    request_queue_size = LISTEN_BACKLOG

    def finish_request(self, request: Any, client_address: Any) -> None:
        request.settimeout(CLIENT_TIMEOUT)
        if self.ssl_context is None:
            super().finish_request(request, client_address)
            return
        try:
            tls = self.ssl_context.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError) as err:
            log.debug(event("metrics.tls_handshake_failed", client=client_address[0], error=err))
            return
        try:
            super().finish_request(tls, client_address)
        finally:
            self.shutdown_request(tls)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A scraper that hangs up mid-response is not worth a traceback on stderr.
        log.debug(event("metrics.request_failed", client=client_address[0]), exc_info=True)


class MetricsServer:
    """A running metrics endpoint; ``close()`` (or leaving the ``with``) stops it."""

    def __init__(self, httpd: _Server, address: str, port: int, scheme: str) -> None:
        self._httpd = httpd
        self.address = address
        self.port = port
        self.scheme = scheme
        self._thread = threading.Thread(target=httpd.serve_forever, name=f"metrics-{port}", daemon=True)
        self._thread.start()
        self._closed = False

    @property
    def target(self) -> str:
        """``host:port`` for Prometheus; a wildcard bind is reached by the host's name."""
        host = self.address
        if host in ("", "0.0.0.0", "::"):
            host = socket.getfqdn()
        elif ":" in host:
            host = f"[{host}]"
        return f"{host}:{self.port}"

    @property
    def url(self) -> str:
        """The metrics URL (``http://127.0.0.1:9850/metrics``)."""
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{self.scheme}://{host}:{self.port}/metrics"

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving and release the port; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout)
        log.info(event("metrics.stopped", address=self.address, port=self.port))

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _family(address: str) -> socket.AddressFamily:
    try:
        return socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
    except ValueError:
        infos = socket.getaddrinfo(address, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        return infos[0][0]


def _bind(address: str, ports: list[int], app: WSGIApp) -> _Server | None:
    """A server bound and listening on the first port of ``ports`` that binds; None if none does."""
    server_class: type[_Server] = type("_BoundServer", (_Server,), {"address_family": _family(address)})
    for port in ports:
        try:
            httpd = server_class((address, port), _Handler)
        except OSError as err:
            # EADDRINUSE from bind(), or from listen() when another process
            # bound the same port a moment before us (SO_REUSEADDR).
            if err.errno in (errno.EADDRINUSE, errno.EACCES):
                continue
            raise HostError(f"cannot listen for metrics on {address}:{port}: {err.strerror}",
                            errno=err.errno) from err
        httpd.set_app(app)
        return httpd
    return None


#: Serves a path other than /metrics: ``(content_type, body)``, or None for 404.
PageResolver = Callable[[str], "tuple[str, bytes] | None"]

#: Pages (heat maps: a PNG costs CPU) rendered at once; more are answered 503 so /metrics stays fast.
PAGE_CONCURRENCY = 2


def _with_pages(metrics_app: WSGIApp, pages: PageResolver) -> WSGIApp:
    """Route ``/metrics`` (and ``/``) to Prometheus, any other GET path to ``pages``."""

    busy = threading.BoundedSemaphore(PAGE_CONCURRENCY)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO") or "/"
        if environ.get("REQUEST_METHOD", "GET") not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Content-Type", "text/plain"), ("Allow", "GET, HEAD")])
            return [b"only GET and HEAD\n"]
        if path in ("/", "/metrics"):
            return metrics_app(environ, start_response)
        if not busy.acquire(blocking=False):
            start_response("503 Service Unavailable", [("Content-Type", "text/plain"), ("Retry-After", "1")])
            return [b"busy: retry\n"]
        try:
            page = pages(path)
        except Exception as err:  # noqa: BLE001 - a broken page must not take the exporter down
            log.warning(event("metrics.page_failed", path=path, error=err))
            start_response("500 Internal Server Error", [("Content-Type", "text/plain")])
            return [b"page failed\n"]
        finally:
            busy.release()
        if page is None:
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found\n"]
        content_type, body = page
        start_response("200 OK", [("Content-Type", content_type), ("Content-Length", str(len(body)))])
        return [body]

    return app


def serve_metrics(
    registry: CollectorRegistry,
    *,
    address: str = DEFAULT_ADDRESS,
    ports: Iterable[int] = DEFAULT_PORTS,
    tls: MetricsTLS | None = None,
    basic_auth: MetricsBasicAuth | None = None,
    pages: PageResolver | None = None,
) -> MetricsServer:
    """Serve ``registry`` at ``/metrics`` on ``address`` and the first free port of ``ports``.

    ``pages`` serves other paths (the agent's heat maps), behind the same
    TLS and basic auth. Port 0 lets the kernel choose. Serving runs in a
    daemon thread until :meth:`MetricsServer.close`. Raises HostError when
    no port of the range is free or the address cannot be bound,
    ConfigError when the TLS files or the password file are unusable.
    """
    ssl_context = tls_context(tls) if tls is not None else None
    app: WSGIApp = make_wsgi_app(registry)
    if pages is not None:
        app = _with_pages(app, pages)
    if basic_auth is not None:
        app = _require_basic_auth(app, basic_auth_credentials(basic_auth))
        if tls is None and not _is_loopback(address):
            log.warning(event("metrics.basic_auth_without_tls", address=address,
                              hint="the password crosses the network in clear text"))
    port_list = list(ports)
    httpd = _bind(address, port_list, app)
    if httpd is None:
        shown = f"{port_list[0]}-{port_list[-1]}" if port_list else "(none)"
        raise HostError(f"no free port for metrics on {address} in {shown}", errno=errno.EADDRINUSE)
    httpd.ssl_context = ssl_context
    port = httpd.server_address[1]
    scheme = "https" if ssl_context else "http"
    server = MetricsServer(httpd, address, port, scheme)
    log.info(event("metrics.serving", url=server.url, basic_auth=basic_auth is not None))
    return server


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"
