"""The gateway's request timers and /metrics rendering, with a fake engine (no processes)."""

from __future__ import annotations

import asyncio

import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from common.messages import FinishReason, GenerateRequest
from common.messages.types import SamplingParams
from services.gateway.engine.client import OutputDelta
from services.gateway.engine.replicas import merge_stats
from services.gateway.http import metrics as metrics_module
from services.gateway.http.metrics import GatewayMetrics, install_metrics
from services.gateway.http.scheduler_metrics import SchedulerStats
from tests.fake_engine import FakeEngine
from tests.unit.services.gateway.engine.test_replicas import _stats


def _request(n: int = 1) -> GenerateRequest:
    return GenerateRequest(
        request_id="r",
        model="m",
        prompt_token_ids=[1, 2, 3],
        sampling=SamplingParams(max_tokens=8, n=n),
    )


def _delta(
    tokens: list[int], finish: FinishReason = FinishReason.NONE, last: bool = False, index: int = 0
) -> OutputDelta:
    return OutputDelta(
        text="x" * len(tokens),
        token_ids=tokens,
        finish_reason=finish,
        num_prompt_tokens=3,
        num_output_tokens=len(tokens),
        last=last,
        index=index,
    )


def _samples(metrics: GatewayMetrics) -> dict[str, float]:
    text = asyncio.run(metrics.render()).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            extra = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + (f"{{{extra}}}" if extra else "")] = s.value
    return out


def test_tokens_and_latencies_of_a_request() -> None:
    metrics = GatewayMetrics(
        FakeEngine(
            stats={
                "num_running": 2,
                "num_waiting": 1,
                "kv_cache_usage": 0.25,
                "num_preemptions": 4,
                "prefix_cache_queries": 100,
                "prefix_cache_hits": 32,
            }
        )
    )
    timer = metrics.observe(_request())
    timer.delta(_delta([]))  # a delta with no text yet: queue time, not TTFT
    timer.delta(_delta([5, 6, 7]))  # first token, then two more
    timer.delta(_delta([8], FinishReason.LENGTH, last=True))
    timer.end()
    m = _samples(metrics)
    assert m["shuttle:prompt_tokens_total"] == 3
    assert m["shuttle:generation_tokens_total"] == 4
    assert m["shuttle:time_to_first_token_seconds_count"] == 1
    assert m["shuttle:request_queue_time_seconds_count"] == 1
    assert m["shuttle:inter_token_latency_seconds_count"] == 3
    assert m["shuttle:e2e_request_latency_seconds_count"] == 1
    assert m["shuttle:request_success_total{finished_reason=length}"] == 1
    assert m["shuttle:num_requests_running"] == 2 and m["shuttle:num_requests_waiting"] == 1
    assert m["shuttle:kv_cache_usage_perc"] == 0.25
    assert m["shuttle:num_preemptions_total"] == 4
    assert (m["shuttle:prefix_cache_queries_total"], m["shuttle:prefix_cache_hits_total"]) == (
        100,
        32,
    )


def test_n_sequences_each_finish_and_a_dropped_one_is_cancelled() -> None:
    metrics = GatewayMetrics(FakeEngine())
    timer = metrics.observe(_request(n=3))
    timer.delta(_delta([5], index=0))
    timer.delta(_delta([6], FinishReason.STOP, index=1))
    timer.end()  # the client left with sequences 0 and 2 unfinished
    m = _samples(metrics)
    assert m["shuttle:request_success_total{finished_reason=stop}"] == 1
    assert m["shuttle:request_success_total{finished_reason=cancelled}"] == 2
    assert m["shuttle:e2e_request_latency_seconds_count"] == 1


def test_each_of_n_sequences_keeps_its_own_inter_token_clock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = [0.0]
    monkeypatch.setattr(metrics_module.time, "perf_counter", lambda: clock[0])
    metrics = GatewayMetrics(FakeEngine())
    timer = metrics.observe(_request(n=2))
    for t in (1.0, 2.0, 3.0):  # both sequences decode one token a second, in one batch
        clock[0] = t
        finish = FinishReason.LENGTH if t == 3.0 else FinishReason.NONE
        timer.delta(_delta([5], finish, index=0))
        timer.delta(_delta([6], finish, last=t == 3.0, index=1))
    m = _samples(metrics)
    # two gaps of 1 s per sequence; a sibling's token in the same batch is no 0 s gap
    assert m["shuttle:inter_token_latency_seconds_count"] == 4
    assert m["shuttle:inter_token_latency_seconds_sum"] == 4.0
    assert m["shuttle:time_to_first_token_seconds_count"] == 1


def test_refused_request_and_a_silent_scheduler() -> None:
    metrics = GatewayMetrics(FakeEngine(stats=None))  # stats() times out: last values (zeros) stay
    timer = metrics.observe(_request())
    timer.failed(400)
    timer.end()
    m = _samples(metrics)
    assert m["shuttle:request_failure_total{status=400}"] == 1
    assert "shuttle:e2e_request_latency_seconds_count" not in m
    assert m["shuttle:num_requests_running"] == 0


def test_installed_metrics_time_the_engines_requests() -> None:
    engine = FakeEngine(stats={})
    metrics = install_metrics(FastAPI(), engine)
    assert engine.observer is not None
    timer = engine.observer(_request())
    timer.delta(_delta([5], FinishReason.STOP, last=True))
    timer.end()
    m = _samples(metrics)
    assert m["shuttle:request_success_total{finished_reason=stop}"] == 1
    assert m["shuttle:time_to_first_token_seconds_count"] == 1


# The series vLLM's Grafana dashboard (examples/observability/prometheus_grafana/grafana.json)
# queries, and the ones an operator of vLLM graphs or scales on beside it: under
# --metrics-vllm-names every one is exposed by that exact name.
VLLM_DASHBOARD_SERIES = (
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",  # its name before vLLM 0.10
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_bucket",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_bucket",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_bucket",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_inference_time_seconds_bucket",
    "vllm:request_time_per_output_token_seconds_bucket",  # what Ray's vLLM dashboard queries
    "vllm:request_max_num_generation_tokens_bucket",
    "vllm:request_max_num_generation_tokens_sum",
    "vllm:request_params_n_bucket",
    "vllm:request_params_max_tokens_bucket",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
)


def _series(metrics: GatewayMetrics) -> set[str]:
    text = asyncio.run(metrics.render()).decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def _one_finished_request(metrics: GatewayMetrics) -> None:
    timer = metrics.observe(_request())
    timer.delta(_delta([5]))
    timer.delta(_delta([6], FinishReason.STOP, last=True))
    timer.end()


def test_vllm_names_cover_what_vllms_dashboard_queries() -> None:
    metrics = install_metrics(FastAPI(), FakeEngine(stats={}), vllm_names=True)
    _one_finished_request(metrics)
    series = _series(metrics)
    missing = [name for name in VLLM_DASHBOARD_SERIES if name not in series]
    assert not missing, missing
    assert not any(name.startswith("shuttle:") for name in series)


def test_shuttle_names_stay_without_the_flag() -> None:
    metrics = install_metrics(FastAPI(), FakeEngine(stats={}))
    _one_finished_request(metrics)
    series = _series(metrics)
    expected = {name.replace("vllm:", "shuttle:", 1) for name in VLLM_DASHBOARD_SERIES}
    expected.discard("shuttle:gpu_cache_usage_perc")  # vLLM's old name: only under its prefix
    assert not expected - series, expected - series
    assert not any(name.startswith("vllm:") for name in series)


def test_flag_reaches_the_apps_metrics() -> None:
    from common.config import ServerConfig
    from services.gateway.http.app import create_app

    app = create_app(FakeEngine(stats={}), ServerConfig(metrics_vllm_names=True))
    assert app.state.metrics.prefix == "vllm"


def test_per_request_histograms(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [10.0]
    monkeypatch.setattr(metrics_module.time, "perf_counter", lambda: clock[0])
    metrics = GatewayMetrics(FakeEngine())
    request = GenerateRequest(
        request_id="r",
        model="m",
        prompt_token_ids=[1, 2, 3],
        sampling=SamplingParams(max_tokens=30, n=2),
    )
    timer = metrics.observe(request)  # arrives at 10 s
    clock[0] = 12.0  # first token of sequence 0 at 12 s: prefill 2 s
    timer.delta(_delta([5, 6], index=0))
    clock[0] = 13.0
    timer.delta(_delta([7], FinishReason.STOP, index=1))
    clock[0] = 15.5  # the last token at 15.5 s: decode 3.5 s
    timer.delta(_delta([8, 9, 10], FinishReason.LENGTH, last=True, index=0))
    timer.end()
    m = _samples(metrics)
    assert m["shuttle:request_prompt_tokens_sum"] == 3
    assert m["shuttle:request_generation_tokens_sum"] == 6  # 5 + 1 over both sequences
    assert m["shuttle:request_max_num_generation_tokens_sum"] == 5
    assert m["shuttle:request_params_n_sum"] == 2
    assert m["shuttle:request_params_max_tokens_sum"] == 30
    assert m["shuttle:request_prefill_time_seconds_sum"] == 2.0
    assert m["shuttle:request_decode_time_seconds_sum"] == 3.5
    assert m["shuttle:request_inference_time_seconds_sum"] == 5.5
    # 3.5 s of decode over the 4 tokens after the first of the longest sequence (5 tokens)
    assert m["shuttle:request_time_per_output_token_seconds_sum"] == 3.5 / 4
    assert m["shuttle:request_params_n_count"] == 1  # once per request, not per sequence


def test_a_refused_request_observes_no_request_histogram() -> None:
    metrics = GatewayMetrics(FakeEngine())
    timer = metrics.observe(_request())
    timer.failed(429)
    timer.end()
    m = _samples(metrics)
    assert "shuttle:request_prompt_tokens_count" not in m
    assert "shuttle:request_params_n_count" not in m


def test_an_unset_chat_max_tokens_is_not_observed_as_zero() -> None:
    metrics = GatewayMetrics(FakeEngine())
    request = GenerateRequest(
        request_id="r", model="m", messages=[{"role": "user", "content": "x"}],
        sampling=SamplingParams(max_tokens=0),
    )  # fmt: skip
    timer = metrics.observe(request)
    timer.delta(_delta([5], FinishReason.STOP, last=True))
    timer.end()
    m = _samples(metrics)
    assert "shuttle:request_params_max_tokens_count" not in m
    assert m["shuttle:request_params_n_count"] == 1


def test_metrics_are_labelled_by_replica() -> None:
    collector = SchedulerStats(lambda: "m")
    merged = merge_stats({"scheduler-0": _stats(), "scheduler-1": _stats()}, 2)
    merged["router"] = {"num_prefix_routed": 7, "num_least_loaded_routed": 3}
    collector.update(merged)
    families = {f.name: f for f in collector.collect()}
    hits = families["shuttle:prefix_cache_hits"]
    assert [(s.labels["replica"], s.value) for s in hits.samples if s.name.endswith("_total")] == [
        ("0", 40.0),
        ("1", 40.0),
    ]
    routed = families["shuttle:dp_routed_requests"]
    assert sorted((s.labels["how"], s.value) for s in routed.samples) == [
        ("least_loaded", 3.0),
        ("prefix", 7.0),
    ]


def test_prefill_and_decode_replicas_export_their_roles_and_hand_overs() -> None:
    collector = SchedulerStats(lambda: "m")
    prefill = _stats(role="prefill", kv_handover_num_handed_over=3, kv_handover_bytes_sent=900)
    decode = _stats(role="decode", kv_handover_num_received=3, kv_handover_transfer_s=0.25)
    merged = merge_stats({"scheduler-0": prefill, "scheduler-1": decode}, 2)
    assert merged["kv_handover_num_handed_over"] == 3 and merged["kv_handover_transfer_s"] == 0.25
    collector.update(merged)
    families = {f.name: f for f in collector.collect()}
    roles = families["shuttle:replica_role_info"]
    assert sorted((s.labels["replica"], s.labels["role"]) for s in roles.samples) == [
        ("0", "prefill"),
        ("1", "decode"),
    ]
    sent = families["shuttle:kv_handover_sent_bytes"]
    assert [(s.labels["replica"], s.value) for s in sent.samples if s.name.endswith("_total")] == [
        ("0", 900.0),
        ("1", 0.0),
    ]
    assert "shuttle:kv_handover_transfer_seconds" in families
    assert families["shuttle:kv_handover_imports_in_flight"].type == "gauge"
    plain = SchedulerStats(lambda: "m")  # replicas without roles: no such family
    plain.update(merge_stats({"scheduler-0": _stats(), "scheduler-1": _stats()}, 2))
    names = {f.name for f in plain.collect()}
    assert not {n for n in names if "handover" in n or "role" in n}
    assert "kv_handover_num_handed_over" not in merge_stats({"scheduler-0": _stats()}, 1)


def test_kv_cache_dtype_and_blocks_are_exported() -> None:
    """--kv-cache-dtype: the pool's blocks as a gauge and vLLM's cache_config_info, alone and
    merged over replicas."""
    for stats in (
        {**_stats(), "kv_cache_dtype": "int8", "block_size": 16},
        merge_stats(
            {
                f"scheduler-{i}": {**_stats(), "kv_cache_dtype": "int8", "block_size": 16}
                for i in range(2)
            },
            2,
        ),  # fmt: skip
    ):
        collector = SchedulerStats(lambda: "m")
        collector.update(stats)
        families = {f.name: f for f in collector.collect()}
        (info,) = families["shuttle:cache_config_info"].samples
        assert info.value == 1.0 and info.labels["cache_dtype"] == "int8"
        assert info.labels["block_size"] == "16"
        assert info.labels["num_gpu_blocks"] == str(stats["num_total_blocks"])
        blocks = families["shuttle:kv_cache_num_blocks"].samples
        assert sum(s.value for s in blocks) == stats["num_total_blocks"]  # per replica, summed
