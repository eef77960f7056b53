"""deploy/grafana: the dashboard is valid JSON whose every query names only series that
shuttle's /metrics exports, and the provisioning points Grafana at it and at Prometheus."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from fastapi import FastAPI

from services.gateway.http.metrics import install_metrics
from tests.fake_engine import FakeEngine
from tests.unit.services.gateway.http.test_metrics import _one_finished_request, _series

REPO = Path(__file__).resolve().parents[3]
GRAFANA = REPO / "deploy/grafana"
SERIES = re.compile(r"shuttle:[a-z0-9_]+")


def _dashboard() -> dict:
    return json.loads((GRAFANA / "shuttle.json").read_text())


def _exported() -> set[str]:
    metrics = install_metrics(FastAPI(), FakeEngine(stats={}))
    _one_finished_request(metrics)
    return _series(metrics)


def test_every_panel_queries_series_shuttle_exports() -> None:
    exported = _exported()
    panels = _dashboard()["panels"]
    queried = {name for p in panels for t in p["targets"] for name in SERIES.findall(t["expr"])}
    assert queried, "the dashboard queries nothing"
    assert sorted(queried - exported) == []


def test_the_dashboard_covers_the_headline_metrics() -> None:
    exprs = " ".join(t["expr"] for p in _dashboard()["panels"] for t in p["targets"])
    for name in (
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prefix_cache_hits_total",
        "num_preemptions_total",
        "generation_tokens_total",
    ):
        assert f"shuttle:{name}" in exprs, name


def test_panels_are_laid_out_without_overlap() -> None:
    cells: set[tuple[int, int]] = set()
    for p in _dashboard()["panels"]:
        g = p["gridPos"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & mine, p["title"]
        assert g["x"] + g["w"] <= 24
        cells |= mine


def test_provisioning_names_the_dashboard_folder_and_prometheus() -> None:
    sources = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yaml").read_text())
    (source,) = sources["datasources"]
    uids = {t["datasource"]["uid"] for p in _dashboard()["panels"] for t in p["targets"]}
    assert uids == {source["uid"]} and source["url"] == "http://prometheus:9090"
    boards = yaml.safe_load((GRAFANA / "provisioning/dashboards/shuttle.yaml").read_text())
    assert boards["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    scrape = yaml.safe_load((REPO / "deploy/prometheus/prometheus.yml").read_text())
    (job,) = scrape["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == ["gateway:8000"]
