"""A real Prometheus server finds vmcache agents through file_sd and reads their metrics.

Starts Debian's /usr/bin/prometheus on a free loopback port with the
project's docs/prometheus/scrape.yml (its ``/run/vmcache/prometheus/*.json``
glob pointed at ``<tmp>/run/prometheus/*.json``, 1s intervals) and alerts.yml.

Discovery is tested with real agents, started as operators start them: the
hook installed (scripts/install.sh --hook-only) with a host config whose
``runtime_dir`` is ``<tmp>/run``, so the agents write their targets files
into the directory Prometheus globs, and two transient paused domains with
vmcache metadata (needs root and libvirtd, see livelib.py). What needs
metrics a real agent only has in situations that are hard to make (TLS
with basic auth, every dashboard panel with data) uses stand-in agents
built from the real parts (AgentMetrics fed with CycleStats,
serve_metrics, TargetsFile): ``start_agent``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid as uuidlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from vmcache.observe.exporter import DEFAULT_PORTS, MetricsServer, serve_metrics
from vmcache.settings.metrics import MetricsBasicAuth, MetricsTLS
from vmcache.observe.filesd import TargetsFile
from vmcache.observe.metrics import AgentMetrics
from vmcache.model.stats import CycleStats
from vmcache.host.files import file_stem
from vmcache.model.extents import BitmapRead

pytestmark = pytest.mark.live

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
MiB = 1 << 20
TIMEOUT = 20.0
PREFIX = f"vmcache-test-prom-{os.getpid()}-"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Prometheus:
    url: str
    runtime_dir: Path  # an agent's runtime_dir whose prometheus/ is targets_dir
    targets_dir: Path
    tls_targets_dir: Path
    log: Path

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=5) as resp:
            body = json.load(resp)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return self.api("query", query=expr)["result"]

    def active_domains(self, job: str = "vmcache") -> set[str]:
        """The ``domain`` labels of the active targets of ``job``."""
        data = self.api("targets", state="active")
        return {t["labels"].get("domain", "") for t in data["activeTargets"] if t["labels"]["job"] == job}

    def wait(self, what: str, check: Callable[[], Any], timeout: float = TIMEOUT) -> Any:
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            last = check()
            if last:
                return last
            time.sleep(0.25)
        tail = self.log.read_text(errors="replace")[-3000:]
        raise AssertionError(f"timed out waiting for {what}; last: {last!r}\nprometheus log:\n{tail}")


def _config(targets: Path, tls_targets: Path, ca: Path, password_file: Path) -> dict[str, Any]:
    """docs/prometheus/scrape.yml with test paths and intervals, plus its commented HTTPS job."""
    config = yaml.safe_load((DOCS / "prometheus" / "scrape.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(DOCS / "prometheus" / "alerts.yml")]
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "vmcache"]
    assert job["file_sd_configs"][0]["files"] == ["/run/vmcache/prometheus/*.json"]
    job["file_sd_configs"] = [{"files": [str(targets / "*.json")], "refresh_interval": "1s"}]
    tls_job = {
        **job,
        "job_name": "vmcache-tls",
        "scheme": "https",
        "tls_config": {"ca_file": str(ca)},
        "basic_auth": {"username": "prometheus", "password_file": str(password_file)},
        "file_sd_configs": [{"files": [str(tls_targets / "*.json")], "refresh_interval": "1s"}],
    }
    config["scrape_configs"].append(tls_job)
    return config


@pytest.fixture(scope="module")
def secrets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("secrets")
    key, crt, pw = d / "key.pem", d / "cert.pem", d / "metrics.password"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=vmcache",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(crt)],
                   check=True, capture_output=True)
    pw.write_text("correct horse battery\n")
    return {"key": key, "cert": crt, "password": pw}


@pytest.fixture(scope="module")
def prometheus(live_tmp: Path, secrets: dict[str, Path]) -> Iterator[Prometheus]:
    if not Path(PROMETHEUS).exists():
        pytest.fail(f"{PROMETHEUS} missing: install the Debian package prometheus (scripts/setup.sh)")
    d = live_tmp / "prometheus"
    runtime = live_tmp / "run"
    targets, tls_targets = runtime / "prometheus", d / "tls-targets"
    targets.mkdir(parents=True)
    tls_targets.mkdir(parents=True)
    (d / "prometheus.yml").write_text(yaml.safe_dump(_config(targets, tls_targets, secrets["cert"], secrets["password"])))
    port = _free_port()
    log = d / "prometheus.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={d / 'prometheus.yml'}", f"--storage.tsdb.path={d / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=info"],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        server = Prometheus(f"http://127.0.0.1:{port}", runtime, targets, tls_targets, log)

        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"prometheus exited {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{server.url}/-/ready", timeout=1) as resp:
                    return resp.status == 200
            except OSError:
                return False

        server.wait("prometheus ready", ready)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class StandInAgent:
    """What a per-domain agent does for observability, without libvirt."""

    domain: str
    uuid: str
    pinned_bytes: int
    metrics: AgentMetrics
    server: MetricsServer
    targets: TargetsFile
    stopped: bool = field(default=False)

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.targets.remove()
            self.server.close()


@pytest.fixture
def start_agent(prometheus: Prometheus) -> Iterator[Callable[..., StandInAgent]]:
    agents: list[StandInAgent] = []

    def start(domain: str, pinned_mib: int, *, tls: MetricsTLS | None = None,
              basic_auth: MetricsBasicAuth | None = None) -> StandInAgent:
        uuid = str(uuidlib.uuid4())
        metrics = AgentMetrics(domain, uuid, registry=CollectorRegistry(), version="0.0.0-live")
        disk = metrics.disk("vda", f"/var/lib/libvirt/images/{domain}.raw")
        for i in range(3):
            disk.observe(CycleStats(
                now=float(i), duration_seconds=0.02, size_bytes=2048 * MiB, budget_bytes=512 * MiB,
                pinned_bytes=pinned_mib * MiB, pinned_regions=3, resident_bytes=(pinned_mib + 40) * MiB,
                guest_written_bytes=MiB, guest_read_miss_bytes=2 * MiB, recently_evicted_pages=10,
                bitmap_read=BitmapRead.OK, mem_available_bytes=8192 * MiB, backing_off=False))
            disk.observe_reads(6 * MiB, 4 * MiB, 0)  # the guest's reads, counted by the kernel
        metrics.set_share(budget=512 * MiB, granted=pinned_mib * MiB, demand=(pinned_mib + 8) * MiB, minimum=0,
                          cap=1024 * MiB)
        server = serve_metrics(metrics.registry, ports=DEFAULT_PORTS, tls=tls, basic_auth=basic_auth)
        directory = prometheus.tls_targets_dir if tls else prometheus.targets_dir
        targets = TargetsFile(domain, uuid, server.target, directory=directory)
        agent = StandInAgent(domain, uuid, pinned_mib * MiB, metrics, server, targets)
        agents.append(agent)
        targets.write()
        return agent

    try:
        yield start
    finally:
        for agent in agents:
            agent.stop()


def _by_domain(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["metric"].get("domain", ""): r for r in results}


@pytest.fixture(scope="module")
def host(live_tmp: Path, prometheus: Prometheus, hooked) -> Iterator[Any]:
    """Real agents: the hook installed for a host config whose runtime_dir is the one Prometheus globs below."""
    from tests.live import livelib

    config = live_tmp / "vmcache.yaml"
    config.write_text(yaml.safe_dump({
        "runtime_dir": str(prometheus.runtime_dir), "log_dir": f"{live_tmp}/log", "hotset_dir": f"{live_tmp}/hotsets",
        "interval": "1s",
        "min_free": "256M", "pinned_cap": "256M", "agent_command": [sys.executable, "-m", "vmcache", "agent"],
        "model": {"decay": 0.5, "block_size": "1M"},
    }))
    env = livelib.LiveEnv(livelib.connect(), live_tmp, config)
    assert env.run == prometheus.runtime_dir
    hooked(config, PREFIX, env.agents)
    try:
        yield env
    finally:
        env.conn.close()


def test_two_real_agents_are_discovered_queried_and_dropped_on_virsh_destroy(prometheus: Prometheus,
                                                                              host: Any) -> None:
    from tests.live import guestlib, livelib

    budgets = {PREFIX + "web": 16 * MiB, PREFIX + "db": 24 * MiB}
    doms = {}
    for name, budget in budgets.items():
        xml = livelib.domain_xml(name, host.disk(name, 64 * MiB), metadata=livelib.cache_metadata(f"{budget // MiB}M"))
        doms[name] = livelib.start_paused(host.conn, xml)
    for name, dom in doms.items():
        livelib.wait_for(lambda n=name: (s := host.status(n)) and s["state"] == "running", f"the agent of {name}")
        guestlib.guest_write(dom, 0, 4 * MiB)
    pattern = "|".join(budgets)

    def pinned() -> dict[str, dict[str, Any]]:
        # The guests keep writing: with this host's model (decay 0.5 a 1 s cycle) a region written once is
        # released within ~5 s, and Prometheus must first find the targets (the test failed so, twice).
        for dom in doms.values():
            guestlib.guest_write(dom, 0, 4 * MiB)
        got = _by_domain(prometheus.query(f'vmcache_pinned_bytes{{domain=~"{pattern}"}}'))
        return got if set(got) == set(budgets) and all(float(r["value"][1]) >= 4 * MiB for r in got.values()) else {}

    try:
        got = prometheus.wait("both real agents' pinned bytes", pinned, timeout=60)
    except AssertionError as err:  # say what the agents saw: the Prometheus log alone does not
        agents = "\n".join(f"{n}: status {host.status(n)}\nlog tail:\n{host.agent_log(n)[-2500:]}" for n in budgets)
        raise AssertionError(f"{err}\n{agents}\nhook log tail:\n{host.hook_log()[-1500:]}") from None
    for name, dom in doms.items():
        series = got[name]
        assert float(series["value"][1]) <= budgets[name]
        labels = series["metric"]
        assert labels["uuid"] == dom.UUIDString()
        assert labels["target_device"] == "vda"
        assert labels["source_file"] == str(host.tmp / f"{file_stem(name)}.raw")
        assert labels["job"] == "vmcache"
        assert labels["instance"] == urllib.parse.urlsplit(host.status(name)["metrics_url"]).netloc
        assert not any(k.startswith("exported_") for k in labels)
        assert (prometheus.targets_dir / f"{file_stem(name)}.json").exists()
    budget_series = _by_domain(prometheus.query(f'vmcache_budget_bytes{{domain=~"{pattern}"}}'))
    assert {d: float(r["value"][1]) for d, r in budget_series.items()} == budgets
    up = _by_domain(prometheus.query(f'up{{job="vmcache", domain=~"{pattern}"}}'))
    assert {d: float(r["value"][1]) for d, r in up.items()} == {name: 1.0 for name in budgets}

    # virsh destroy: the hook stops the agent, which removes its targets file; Prometheus drops the target.
    gone, kept = budgets
    subprocess.run(["virsh", "-c", livelib.URI, "destroy", gone], check=True, capture_output=True, timeout=60)
    livelib.wait_for(lambda: host.agent_pid(gone) is None, "the destroyed domain's agent to exit")
    assert not (prometheus.targets_dir / f"{file_stem(gone)}.json").exists()
    prometheus.wait("the destroyed domain's target to go", lambda: gone not in prometheus.active_domains())
    assert kept in prometheus.active_domains()
    subprocess.run(["virsh", "-c", livelib.URI, "destroy", kept], check=True, capture_output=True, timeout=60)
    livelib.wait_for(lambda: host.agent_pid(kept) is None, "the other agent to exit")
    prometheus.wait("no target of ours left", lambda: not set(budgets) & prometheus.active_domains())
    assert not [p for p in prometheus.targets_dir.glob("*.json") if p.stem.startswith(PREFIX)]


def test_https_agent_with_basic_auth_is_scraped(prometheus: Prometheus, secrets: dict[str, Path],
                                                start_agent: Callable[..., StandInAgent]) -> None:
    agent = start_agent("live-tls", 128, tls=MetricsTLS(str(secrets["cert"]), str(secrets["key"])),
                        basic_auth=MetricsBasicAuth("prometheus", str(secrets["password"])))
    assert agent.server.scheme == "https"
    got = prometheus.wait("the TLS agent's pinned bytes",
                          lambda: prometheus.query('vmcache_pinned_bytes{domain="live-tls", job="vmcache-tls"}'))
    assert float(got[0]["value"][1]) == 128 * MiB


def test_alert_rules_load_and_evaluate(prometheus: Prometheus) -> None:
    expected = {r["alert"] for g in yaml.safe_load((DOCS / "prometheus" / "alerts.yml").read_text())["groups"]
                for r in g["rules"]}

    def evaluated() -> dict[str, str]:
        rules = {r["name"]: r["health"] for g in prometheus.api("rules")["groups"] for r in g["rules"]}
        return rules if rules and all(h != "unknown" for h in rules.values()) else {}

    health = prometheus.wait("rules evaluated", evaluated)
    assert set(health) == expected
    assert set(health.values()) == {"ok"}


def test_grafana_dashboard_queries_run_and_find_data(prometheus: Prometheus,
                                                      start_agent: Callable[..., StandInAgent]) -> None:
    start_agent("live-dash", 32)
    prometheus.wait("the dashboard agent", lambda: prometheus.query('vmcache_agent_info{domain="live-dash"}'))
    dashboard = json.loads((DOCS / "grafana" / "vmcache-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 10
    concrete = [e.replace("$__rate_interval", "1m").replace("$domain", "live-dash")
                .replace("$disk", ".*").replace("$job", "vmcache") for e in exprs]
    # Every panel shows data for a running agent, except errors (only those that happened).
    wanted = [e for e in concrete if "vmcache_errors_total" not in e]

    def without_data() -> list[str]:
        return [e for e in wanted if not prometheus.query(e)]

    missing = without_data()
    deadline = time.monotonic() + TIMEOUT
    while missing and time.monotonic() < deadline:  # rates need two scrapes
        time.sleep(0.5)
        missing = without_data()
    assert missing == []
    errors = [e for e in concrete if "vmcache_errors_total" in e]
    assert errors and all(prometheus.query(e) == [] for e in errors)
