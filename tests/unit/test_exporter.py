"""The metrics endpoint over real loopback HTTP(S): port range, TLS, basic auth."""

from __future__ import annotations

import base64
import logging
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.parser import text_string_to_metric_families

from vmcache.errors import ConfigError, HostError
from vmcache.observe.exporter import serve_metrics
from vmcache.settings.metrics import MetricsBasicAuth, MetricsTLS


@pytest.fixture
def registry() -> CollectorRegistry:
    reg = CollectorRegistry()
    Gauge("vmcache_test_value", "a value", registry=reg).set(42)
    return reg


def free_port_block(n: int) -> list[int]:
    """``n`` consecutive ports that were free a moment ago."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            start = s.getsockname()[1]
        ports = list(range(start, start + n))
        if ports[-1] < 65536 and all(_free(p) for p in ports):
            return ports
    raise RuntimeError("no block of free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def fetch(url: str, *, context: ssl.SSLContext | None = None, auth: tuple[str, str] | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url)
    if auth:
        req.add_header("Authorization", "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=5, context=context) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def gauge_value(text: str) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "vmcache_test_value":
                return s.value
    raise AssertionError("vmcache_test_value not served")


def test_serves_the_registry_on_loopback_by_default(registry: CollectorRegistry) -> None:
    ports = free_port_block(3)
    with serve_metrics(registry, ports=ports) as server:
        assert server.address == "127.0.0.1"
        assert server.port == ports[0]
        assert server.target == f"127.0.0.1:{ports[0]}"
        status, body = fetch(server.url)
        assert status == 200
        assert gauge_value(body) == 42


def test_values_are_read_at_scrape_time(registry: CollectorRegistry) -> None:
    g = Gauge("vmcache_live", "changes", registry=registry)
    with serve_metrics(registry, ports=[0]) as server:
        g.set(1)
        assert "vmcache_live 1.0" in fetch(server.url)[1]
        g.set(7)
        assert "vmcache_live 7.0" in fetch(server.url)[1]


def test_taken_port_falls_through_to_the_next_in_the_range(registry: CollectorRegistry) -> None:
    ports = free_port_block(3)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", ports[0]))
        squatter.listen()
        with serve_metrics(registry, ports=ports) as first, serve_metrics(registry, ports=ports) as second:
            assert (first.port, second.port) == (ports[1], ports[2])
            assert fetch(second.url)[0] == 200


def test_full_range_raises_host_error_naming_the_range(registry: CollectorRegistry) -> None:
    ports = free_port_block(2)
    with serve_metrics(registry, ports=ports), serve_metrics(registry, ports=ports):
        with pytest.raises(HostError, match=f"{ports[0]}-{ports[1]}"):
            serve_metrics(registry, ports=ports)


def test_concurrent_starts_never_share_a_port(registry: CollectorRegistry) -> None:
    import threading

    ports = free_port_block(8)
    servers, errors = [], []
    barrier = threading.Barrier(8)

    def start() -> None:
        barrier.wait()
        try:
            servers.append(serve_metrics(registry, ports=ports))
        except Exception as err:  # noqa: BLE001 - collected and asserted below
            errors.append(err)

    threads = [threading.Thread(target=start) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert not errors
        assert sorted(s.port for s in servers) == ports
    finally:
        for s in servers:
            s.close()


def test_close_releases_the_port(registry: CollectorRegistry) -> None:
    server = serve_metrics(registry, ports=[0])
    port = server.port
    server.close()
    server.close()  # twice is fine
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    with serve_metrics(registry, ports=[port]) as again:
        assert again.port == port


def test_ipv6_loopback(registry: CollectorRegistry) -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        server = serve_metrics(registry, address="::1", ports=[0])
    except HostError as err:
        pytest.skip(f"no IPv6 loopback here: {err}")
    with server:
        assert server.target.startswith("[::1]:")
        assert gauge_value(fetch(server.url)[1]) == 42


# --- TLS ---------------------------------------------------------------


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("tls")
    key, crt = d / "key.pem", d / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
         "-keyout", str(key), "-out", str(crt)],
        check=True, capture_output=True,
    )
    return crt, key


def test_tls_serves_https_verified_against_the_self_signed_cert(registry: CollectorRegistry,
                                                               cert: tuple[Path, Path]) -> None:
    crt, key = cert
    with serve_metrics(registry, ports=[0], tls=MetricsTLS(str(crt), str(key))) as server:
        assert server.url.startswith("https://")
        ctx = ssl.create_default_context(cafile=str(crt))
        assert gauge_value(fetch(server.url, context=ctx)[1]) == 42
        # Plain HTTP to the TLS port gets no metrics.
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=3).read()
        # A client that does not trust the cert refuses the server.
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            urllib.request.urlopen(server.url, timeout=3, context=ssl.create_default_context())


def test_tls_client_that_never_handshakes_does_not_block_others(registry: CollectorRegistry,
                                                               cert: tuple[Path, Path]) -> None:
    crt, key = cert
    with serve_metrics(registry, ports=[0], tls=MetricsTLS(str(crt), str(key))) as server:
        with socket.create_connection(("127.0.0.1", server.port)):  # connects, says nothing
            time.sleep(0.2)
            ctx = ssl.create_default_context(cafile=str(crt))
            start = time.monotonic()
            assert gauge_value(fetch(server.url, context=ctx)[1]) == 42
            assert time.monotonic() - start < 3


def test_mutual_tls_requires_a_client_certificate(registry: CollectorRegistry, cert: tuple[Path, Path]) -> None:
    crt, key = cert
    tls = MetricsTLS(str(crt), str(key), client_cafile=str(crt), client_auth_required=True)
    with serve_metrics(registry, ports=[0], tls=tls) as server:
        no_cert = ssl.create_default_context(cafile=str(crt))
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            fetch(server.url, context=no_cert)
        with_cert = ssl.create_default_context(cafile=str(crt))
        with_cert.load_cert_chain(str(crt), str(key))
        assert gauge_value(fetch(server.url, context=with_cert)[1]) == 42


def test_tls_with_missing_key_is_a_config_error(registry: CollectorRegistry, tmp_path: Path,
                                                cert: tuple[Path, Path]) -> None:
    with pytest.raises(ConfigError, match="metrics.tls.certfile"):
        serve_metrics(registry, ports=[0], tls=MetricsTLS(str(cert[0]), str(tmp_path / "nope.pem")))


# --- basic auth --------------------------------------------------------


@pytest.fixture
def password_file(tmp_path: Path) -> Path:
    p = tmp_path / "metrics.pass"
    p.write_text("s3cret-Ω\n")
    return p


def test_basic_auth_accepts_the_right_password_and_rejects_others(registry: CollectorRegistry,
                                                                  password_file: Path) -> None:
    auth = MetricsBasicAuth("prometheus", str(password_file))
    with serve_metrics(registry, ports=[0], basic_auth=auth) as server:
        status, body = fetch(server.url, auth=("prometheus", "s3cret-Ω"))
        assert status == 200 and gauge_value(body) == 42
        for wrong in [None, ("prometheus", "wrong"), ("prometheus", "s3cret-Ω\n"), ("other", "s3cret-Ω"),
                      ("prometheus", "")]:
            status, body = fetch(server.url, auth=wrong)
            assert status == 401, wrong
            assert "vmcache_test_value" not in body


def test_basic_auth_challenge_and_garbage_headers(registry: CollectorRegistry, password_file: Path) -> None:
    auth = MetricsBasicAuth("prometheus", str(password_file))
    with serve_metrics(registry, ports=[0], basic_auth=auth) as server:
        for header in ["Bearer abc", "Basic !!!notbase64", "Basic", "basic " + base64.b64encode(b"x").decode()]:
            req = urllib.request.Request(server.url, headers={"Authorization": header})
            with pytest.raises(urllib.error.HTTPError) as caught:
                urllib.request.urlopen(req, timeout=5)
            assert caught.value.code == 401
            assert caught.value.headers["WWW-Authenticate"].startswith('Basic realm="vmcache"')


def test_basic_auth_over_tls(registry: CollectorRegistry, password_file: Path, cert: tuple[Path, Path]) -> None:
    crt, key = cert
    with serve_metrics(registry, ports=[0], tls=MetricsTLS(str(crt), str(key)),
                       basic_auth=MetricsBasicAuth("prometheus", str(password_file))) as server:
        ctx = ssl.create_default_context(cafile=str(crt))
        assert fetch(server.url, context=ctx, auth=("prometheus", "wrong"))[0] == 401
        assert fetch(server.url, context=ctx, auth=("prometheus", "s3cret-Ω"))[0] == 200


def test_password_is_never_logged(registry: CollectorRegistry, password_file: Path,
                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    with serve_metrics(registry, address="127.0.0.1", ports=[0],
                       basic_auth=MetricsBasicAuth("prometheus", str(password_file))) as server:
        fetch(server.url, auth=("prometheus", "wrong"))
        fetch(server.url, auth=("prometheus", "s3cret-Ω"))
    assert "metrics.serving" in caplog.text
    assert "s3cret" not in caplog.text


@pytest.mark.parametrize("content, user", [(b"", "prometheus"), (b"hunter2\nmore\n", "prometheus"),
                                           (b"hunter2\n", "a:b"), (b"hunter2\n", "")])
def test_unusable_credentials_are_config_errors_without_the_password(registry: CollectorRegistry, tmp_path: Path,
                                                                     content: bytes, user: str) -> None:
    p = tmp_path / "secret.file"
    p.write_bytes(content)
    with pytest.raises(ConfigError) as caught:
        serve_metrics(registry, ports=[0], basic_auth=MetricsBasicAuth(user, str(p)))
    assert "hunter2" not in str(caught.value)


def test_missing_password_file_is_a_config_error_naming_the_file(registry: CollectorRegistry,
                                                                 tmp_path: Path) -> None:
    missing = tmp_path / "absent"
    with pytest.raises(ConfigError, match="absent"):
        serve_metrics(registry, ports=[0], basic_auth=MetricsBasicAuth("prometheus", str(missing)))



def test_pages_are_served_beside_metrics_behind_the_same_auth(registry: CollectorRegistry,
                                                              password_file: Path) -> None:
    def pages(path: str) -> tuple[str, bytes] | None:
        if path == "/heatmap/vda.json":
            return "application/json", b'{"disk": "vda"}'
        if path == "/heatmap/broken.json":
            raise ValueError("arrays changed shape")
        return None

    user = ("prometheus", password_file.read_text().strip())
    with serve_metrics(registry, ports=[0], pages=pages, basic_auth=MetricsBasicAuth("prometheus", str(password_file))) as srv:
        base = f"http://127.0.0.1:{srv.port}"
        assert fetch(base + "/heatmap/vda.json", auth=user) == (200, '{"disk": "vda"}')
        assert fetch(base + "/heatmap/vda.json")[0] == 401
        assert fetch(base + "/heatmap/vdz.json", auth=user)[0] == 404
        assert fetch(base + "/heatmap/broken.json", auth=user)[0] == 500
        status, text = fetch(base + "/metrics", auth=user)
        assert status == 200 and "vmcache_test_value 42.0" in text


def test_pages_refuse_post_and_shed_load_beyond_their_concurrency(registry: CollectorRegistry) -> None:
    import threading
    import urllib.request

    from vmcache.observe.exporter import PAGE_CONCURRENCY

    release = threading.Event()
    entered = threading.Semaphore(0)

    def pages(path: str) -> tuple[str, bytes] | None:
        entered.release()
        release.wait(30)
        return "application/json", b"{}"

    with serve_metrics(registry, ports=[0], pages=pages) as srv:
        base = f"http://127.0.0.1:{srv.port}"
        request = urllib.request.Request(base + "/heatmap/vda.json", data=b"x", method="POST")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 405 and refused.value.headers["Allow"] == "GET, HEAD"
        busy = [threading.Thread(target=fetch, args=(base + "/heatmap/vda.json",)) for _ in range(PAGE_CONCURRENCY)]
        for t in busy:
            t.start()
        for _ in busy:
            assert entered.acquire(timeout=10)  # every slot taken by a page still rendering
        assert fetch(base + "/heatmap/vda.json")[0] == 503
        status, text = fetch(base + "/metrics")
        assert status == 200 and "vmcache_test_value 42.0" in text
        release.set()
        for t in busy:
            t.join(10)
