"""GET /metrics on real processes (the synthetic model: the numbers, not the model, matter)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server import Server, running_server
from tests.waiting import wait_until

# (prompt token ids, max_tokens, stream): every count below is known exactly
REQUESTS = [([1000 + i for i in range(5 + 3 * k)], 4 + k, k % 2 == 0) for k in range(6)]
HISTOGRAMS = (
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
)
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
CANCELLED = "shuttle:request_success_total{finished_reason=cancelled}"
COUNTERS = (
    "prompt_tokens",
    "generation_tokens",
    "request_success",
    "num_preemptions",
    "prefix_cache_queries",
    "prefix_cache_hits",
)


@pytest.fixture(scope="module")
def synthetic() -> Iterator[Server]:
    with running_server("--model", "synthetic") as s:
        yield s


def _scrape(server: Server) -> dict[str, float]:
    """Every sample, keyed by name and its labels other than model_name."""
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            assert s.labels.get("model_name") == server.model, s
            extra = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            samples[s.name + (f"{{{extra}}}" if extra else "")] = s.value
    return samples


def _send(server: Server) -> None:
    with server.client() as c:
        for prompt, max_tokens, stream in REQUESTS:
            body = {
                "model": server.model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": stream,
            }
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text


def test_metrics_count_what_was_sent(synthetic: Server) -> None:
    before = _scrape(synthetic)
    _send(synthetic)
    after = _scrape(synthetic)
    m = {k: v - before.get(k, 0.0) for k, v in after.items()}  # what these requests added
    n = len(REQUESTS)
    assert m["shuttle:prompt_tokens_total"] == sum(len(p) for p, _, _ in REQUESTS)
    assert m["shuttle:generation_tokens_total"] == sum(k for _, k, _ in REQUESTS)
    assert m["shuttle:request_success_total{finished_reason=length}"] == n
    for name in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
    ):
        assert m[f"shuttle:{name}_count"] == n, name
        assert m[f"shuttle:{name}_sum"] > 0, name
        assert m[f"shuttle:{name}_bucket{{le=+Inf}}"] == n, name
    # every token after a request's first is one inter-token observation
    assert m["shuttle:inter_token_latency_seconds_count"] == sum(k - 1 for _, k, _ in REQUESTS)
    # the scheduler's figures, read on scrape: everything finished, every prompt looked up
    assert after["shuttle:num_requests_running"] == 0
    assert after["shuttle:num_requests_waiting"] == 0
    assert 0 <= after["shuttle:kv_cache_usage_perc"] <= 1
    assert m["shuttle:prefix_cache_queries_total"] >= sum(len(p) for p, _, _ in REQUESTS)
    assert m["shuttle:num_preemptions_total"] == 0


def test_every_design_name_is_exposed(synthetic: Server) -> None:
    _send(synthetic)  # a labelled series appears with its first observation
    m = _scrape(synthetic)
    for name in HISTOGRAMS:
        assert f"shuttle:{name}_count" in m and f"shuttle:{name}_bucket{{le=+Inf}}" in m, name
    for name in GAUGES:
        assert f"shuttle:{name}" in m, name
    for name in COUNTERS:
        assert any(k.startswith(f"shuttle:{name}_total") for k in m), name


def test_a_dropped_stream_counts_as_cancelled(synthetic: Server) -> None:
    before = _scrape(synthetic).get(CANCELLED, 0)
    body = {
        "model": synthetic.model,
        "prompt": [1000, 1001],
        "max_tokens": 4000,
        "ignore_eos": True,
        "stream": True,
    }
    with synthetic.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # the first chunk came: drop the stream
    # the gateway notices the disconnect soon after
    wait_until(
        lambda: _scrape(synthetic).get(CANCELLED, 0) == before + 1,
        60,
        "the dropped stream to be counted as cancelled",
    )
