"""The Grafana dashboard and the Prometheus alert rules in deploy/ parse, and every metric they
query is one the services export (a renamed metric fails here, not silently on a dashboard)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from prometheus_client import REGISTRY

import kvmesh.mesh.metrics  # noqa: F401 - registers every kvmesh metric

DEPLOY = Path(__file__).parents[2] / "deploy"
_NAME = re.compile(r"\bkvmesh_[a-z_]+")
_SUFFIXES = ("_bucket", "_sum", "_count", "_created")


def _exported() -> set[str]:
    """Every sample name the process's registry can produce (kvmesh's metrics included)."""
    return {name for names in REGISTRY._collector_to_names.values() for name in names}  # noqa: SLF001


def _queried(exprs: list[str]) -> set[str]:
    found = set()
    for expr in exprs:
        for name in _NAME.findall(expr):
            for suffix in _SUFFIXES:
                name = name.removesuffix(suffix)
            found.add(name)
    return found


def _known(name: str, exported: set[str]) -> bool:
    return (
        name in exported or f"{name}_total" in exported or name.removesuffix("_total") in exported
    )


def test_alert_rules_query_exported_metrics():
    rules = yaml.safe_load((DEPLOY / "prometheus" / "kvmesh-alerts.yml").read_text())
    alerts = [rule for group in rules["groups"] for rule in group["rules"]]
    assert len(alerts) >= 8
    for rule in alerts:
        assert rule["alert"] and rule["expr"] and rule["annotations"]["summary"], rule
    queried = _queried([rule["expr"] for rule in alerts])
    exported = _exported()
    assert {"kvmesh_request_tpot_seconds", "kvmesh_kv_integrity_failures_total"} <= queried
    assert [n for n in queried if not _known(n, exported)] == []


def test_dashboard_panels_query_exported_metrics():
    dashboard = json.loads((DEPLOY / "grafana" / "kvmesh-dashboard.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    assert len(dashboard["panels"]) >= 10 and all(exprs)
    queried = _queried(exprs)
    exported = _exported()
    for wanted in (
        "kvmesh_request_ttft_seconds",
        "kvmesh_prompt_cached_tokens_total",
        "kvmesh_spec_accepted_tokens_total",
        "kvmesh_requests_in_flight",
    ):
        assert wanted in queried
    assert [n for n in queried if not _known(n, exported)] == []
