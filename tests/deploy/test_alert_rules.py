"""Prometheus alert rules shipped in deploy/prometheus: loaded by the compose Prometheus, and every rule reads
series carpool exports (or Prometheus's own `up`), with the fields Prometheus requires."""

from __future__ import annotations

from pathlib import Path

import yaml

from scheduler.telemetry.metric_schema import GATEWAY_METRICS, WORKER_METRICS
from tests.deploy.test_telemetry_dashboard import series_in

PROMETHEUS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"


def rules() -> list[dict]:
    groups = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_prometheus_loads_the_rules_and_compose_mounts_them_beside_its_config() -> None:
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    assert config["rule_files"] == ["alerts.yml"]
    compose = yaml.safe_load((PROMETHEUS.parents[1] / "docker-compose.yml").read_text())
    volumes = compose["services"]["prometheus"]["volumes"]
    assert "./deploy/prometheus/alerts.yml:/etc/prometheus/alerts.yml:ro" in volumes
    assert "./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in volumes


def test_every_rule_is_complete_and_reads_exported_series() -> None:
    documented = {name for spec in (*GATEWAY_METRICS, *WORKER_METRICS) for name in spec.prometheus_names}
    names = [rule["alert"] for rule in rules()]
    assert names and len(names) == len(set(names))
    for rule in rules():
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
        assert rule["labels"]["severity"] in ("critical", "warning", "info") and rule["annotations"]["summary"]
        expr = rule["expr"]
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
        used = series_in(expr)
        assert used <= documented, (rule["alert"], sorted(used - documented))
        assert used or "up{" in expr, rule["alert"]
