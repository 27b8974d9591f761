"""The Prometheus and Grafana files in docs/ are valid and match the metrics the code exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from vmcache.model.pinvalue import PinWorth
from vmcache.observe.metrics import AgentMetrics
from vmcache.model.stats import CycleStats
from vmcache.model.extents import BitmapRead

DOCS = Path(__file__).resolve().parents[2] / "docs"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool (Debian package prometheus) not installed")


def exported_samples() -> set[str]:
    """Every vmcache_* sample name an agent with one disk exports."""
    agent = AgentMetrics("d", "u", registry=CollectorRegistry())
    agent.disk("vda", "/i").observe(CycleStats(
        now=0, duration_seconds=0.1, size_bytes=1, budget_bytes=1, pinned_bytes=1, pinned_regions=1,
        resident_bytes=1, guest_written_bytes=1, guest_read_miss_bytes=1, recently_evicted_pages=1,
        bitmap_read=BitmapRead.OK, mem_available_bytes=1, backing_off=False))
    agent.disks["vda"].observe_reads(2, 1, 0, PinWorth(1, 1, 64.0))
    agent.set_share(budget=2, granted=1, demand=1, minimum=0, cap=4)
    text = generate_latest(agent.registry).decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith("vmcache_") and not s.name.endswith("_created")}


def dashboard_exprs() -> list[str]:
    dashboard = json.loads((DOCS / "grafana" / "vmcache-dashboard.json").read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def _promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=60)


@needs_promtool
def test_alert_rules_pass_promtool_check() -> None:
    result = _promtool("check", "rules", "alerts.yml", cwd=DOCS / "prometheus")
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_alert_rule_unit_tests_pass() -> None:
    result = _promtool("test", "rules", "alerts_test.yml", cwd=DOCS / "prometheus")
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_scrape_config_passes_promtool_check() -> None:
    result = _promtool("check", "config", "scrape.yml", cwd=DOCS / "prometheus")
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    rules = [{"record": f"vmcache:dashboard_{i}", "expr": e.replace("$__rate_interval", "5m")
              .replace("$domain", ".*").replace("$disk", ".*").replace("$job", "vmcache")}
             for i, e in enumerate(dashboard_exprs())]
    (tmp_path / "dash.yml").write_text(yaml.safe_dump({"groups": [{"name": "dash", "rules": rules}]}))
    result = _promtool("check", "rules", "dash.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def _names_in(expr: str) -> set[str]:
    return set(re.findall(r"\bvmcache_[a-z_]+\b", expr))


def test_dashboard_and_alerts_use_only_exported_metrics() -> None:
    exported = exported_samples()
    alerts = yaml.safe_load((DOCS / "prometheus" / "alerts.yml").read_text())
    exprs = dashboard_exprs() + [r["expr"] for g in alerts["groups"] for r in g["rules"]]
    used = set().union(*(_names_in(e) for e in exprs))
    assert used and used <= exported, used - exported


def test_dashboard_is_importable_json_with_variables() -> None:
    dashboard = json.loads((DOCS / "grafana" / "vmcache-dashboard.json").read_text())
    assert dashboard["uid"] and dashboard["title"] == "vmcache"
    names = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "job", "domain", "disk"} <= names
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}"
            assert panel["targets"]


def test_every_exported_metric_is_documented_and_nothing_else() -> None:
    text = (DOCS / "metrics.md").read_text()
    documented = set(re.findall(r"^\| `(vmcache_[a-z_]+)`", text, re.MULTILINE))
    families = set()
    for name in exported_samples():
        for suffix in ("_bucket", "_count", "_sum"):
            if name.startswith("vmcache_cycle_duration_seconds") and name.endswith(suffix):
                name = name[: -len(suffix)]
        families.add(name)
    assert documented == families
