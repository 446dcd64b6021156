"""The Grafana dashboard: valid dashboard JSON whose every query names a series carpool exports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from scheduler.telemetry.metric_schema import GATEWAY_METRICS, WORKER_METRICS

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "dashboards" / "carpool.json"
REQUIRED_PANELS = ("Tokens per second", "Jobs per second", "Time to first token", "Inter-token latency",
                   "Batch occupancy", "KV-cache usage", "Queue depth by lane")


def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def queries(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] if p["type"] != "row" for t in p["targets"]]


def series_in(expr: str) -> set[str]:
    """Metric names a PromQL expression reads (label matchers, groupings and ranges removed)."""
    stripped = re.sub(r"\{[^}]*\}", "", expr)
    stripped = re.sub(r"\b(by|without)\s*\([^)]*\)", "", stripped)
    stripped = re.sub(r"\[[^\]]*\]", "", stripped)
    return set(re.findall(r"\b(?:carpool|gen_ai|http)_[a-zA-Z0-9_:]*", stripped))


def test_dashboard_is_grafana_dashboard_json() -> None:
    dashboard = load_dashboard()
    assert dashboard["uid"] and dashboard["title"] == "carpool"
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    titles = [p["title"] for p in panels]
    for wanted in REQUIRED_PANELS:
        assert any(t.startswith(wanted) for t in titles), wanted
    for panel in panels:
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24 and pos["h"] > 0 and pos["y"] >= 0
        if panel["type"] == "row":
            continue
        assert panel["type"] == "timeseries" and panel["datasource"]["uid"] == "prometheus"
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert ref_ids and len(ref_ids) == len(set(ref_ids))
        for target in panel["targets"]:
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
    # Panels must not overlap on the 24-column grid.
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        pos = panel["gridPos"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, panel["title"]
                cells.add((x, y))


def test_every_query_names_a_documented_series() -> None:
    documented = {name for spec in (*GATEWAY_METRICS, *WORKER_METRICS) for name in spec.prometheus_names}
    used = set().union(*(series_in(expr) for expr in queries(load_dashboard())))
    assert used and used <= documented, sorted(used - documented)
    assert series_in('sum by (carpool_lane) (rate(carpool_jobs_finished_total{carpool_lane="batch"}[5m]))') == {
        "carpool_jobs_finished_total"}
