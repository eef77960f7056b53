"""tools/bench (tools/benchmarks/) against a running shuttle (the synthetic model: fast, and
its counts are exact)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server import Server, running_server
from tools.benchmarks import cli
from tools.benchmarks.load import run_load
from tools.benchmarks.workload import Workload

TOKEN = "bench-test"


@pytest.fixture(scope="module")
def synthetic() -> Iterator[Server]:
    with running_server("--model", "synthetic", "--admin-token", TOKEN) as s:
        yield s


def _run(server: Server, tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "result.json"
    code = cli.main(
        [
            "--url",
            server.url,
            "--admin-token",
            TOKEN,
            "--json",
            str(out),
            "--plot-dir",
            str(tmp_path / "plots"),
            "--no-progress",
            *extra,
        ]
    )
    assert code == 0
    return json.loads(out.read_text())


def _is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_random_workload_rate_sweep_goodput_and_plots(synthetic: Server, tmp_path: Path) -> None:
    """The lean client (the default), two rates, SLOs every request meets, and plots."""
    r = _run(
        synthetic,
        tmp_path,
        "--num-prompts",
        "12",
        "--input-len",
        "8:40",
        "--output-len",
        "4:12",
        "--sweep-rates",
        "40,200",
        "--slo-ttft-ms",
        "60000",
        "--slo-tpot-ms",
        "60000",
    )
    w = r["workload"]
    assert [run["rate"] for run in r["sweep"]] == [40.0, 200.0]
    for s in r["sweep"]:
        assert s["completed"] == 12 and s["failed"] == 0
        # ignore_eos: every request streams exactly its length, and the server's usage agrees
        assert s["output_tokens"] == w["output_tokens"]
        assert s["prompt_tokens"] == w["prompt_tokens"]
        assert sum(q["output_tokens"] for q in s["requests"]) == w["output_tokens"]
        assert all(
            0 < q["ttft"] <= q["e2e"] and len(q["itl"]) < q["output_tokens"] for q in s["requests"]
        )
        assert 1 <= s["peak_concurrency"] <= 12
        for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
            p = s[key]
            assert 0 <= p["median"] <= p["p90"] <= p["p99"], key
        # SLOs of a minute: every request is good
        assert s["goodput"]["good_requests"] == 12 and s["goodput"]["fraction"] == 1.0
    assert r["shuttle"] == r["sweep"][-1]
    assert r["server_stats"]["num_running"] == 0
    for name in ("latency_cdf.png", "rate_sweep.png"):
        assert _is_png(tmp_path / "plots" / name), name


def test_jsonl_workload_with_text_and_token_prompts(synthetic: Server, tmp_path: Path) -> None:
    """httpx as the client, text and token-id prompts, a concurrency cap, an SLO nobody meets."""
    lines = [
        {"prompt": "Tell me about the sea.", "output_len": 5},
        {"prompt_token_ids": [1000, 1001, 1002], "output_len": 7},
        {"prompt": "Hello"},
    ]  # output_len drawn from --output-len
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    r = _run(
        synthetic,
        tmp_path,
        "--jsonl",
        str(path),
        "--output-len",
        "3",
        "--concurrency",
        "2",
        "--slo-ttft-ms",
        "0.001",
        "--client",
        "httpx",
    )
    s = r["shuttle"]
    assert r["workload"]["num_prompts"] == 3 and r["workload"]["source"].startswith("jsonl")
    assert s["completed"] == 3 and s["output_tokens"] == 5 + 7 + 3
    assert [q["output_tokens"] for q in s["requests"]] == [5, 7, 3]
    assert s["requests"][1]["prompt_tokens"] == 3 and s["requests"][0]["prompt_tokens"] > 3
    assert s["peak_concurrency"] <= 2
    assert s["goodput"]["good_requests"] == 0  # nobody answers within a microsecond
    assert _is_png(tmp_path / "plots" / "latency_cdf.png")


@pytest.mark.parametrize("lean", [True, False])
def test_a_refused_request_is_counted_as_failed(synthetic: Server, lean: bool) -> None:
    """Both clients report a 4xx as that request's error and go on with the others."""
    import asyncio

    wl = Workload([[1000, 1001], [1000] * 5], [3, 100_000])  # the second is too long
    timings, _, _ = asyncio.run(
        run_load(synthetic.url, synthetic.model, wl, 1, float("inf"), 0, lean=lean)
    )
    assert not timings[0].error and timings[0].output_tokens == 3
    assert timings[1].error.startswith("HTTP 400"), timings[1].error


@pytest.mark.parametrize("client", ["lean", "httpx"])
def test_every_request_can_ask_for_logprobs_and_a_repetition_penalty(
    synthetic: Server, tmp_path: Path, client: str
) -> None:
    """--logprobs 5 --repetition-penalty 1.1 (the issue-13 cost run): every request asks,
    every output token comes back with its logprobs, and the result says what was asked."""
    r = _run(
        synthetic,
        tmp_path,
        "--num-prompts",
        "4",
        "--input-len",
        "8:24",
        "--output-len",
        "3:6",
        "--logprobs",
        "5",
        "--repetition-penalty",
        "1.1",
        "--client",
        client,
    )
    s = r["shuttle"]
    assert r["workload"]["request_extras"] == {"logprobs": 5, "repetition_penalty": 1.1}
    assert s["completed"] == 4 and s["failed"] == 0
    assert s["logprob_tokens"] == s["output_tokens"] == r["workload"]["output_tokens"]
    plain = _run(synthetic, tmp_path, "--num-prompts", "2", "--output-len", "3")
    assert plain["shuttle"]["logprob_tokens"] == 0 and plain["workload"]["request_extras"] == {}


def test_bad_request_extras_are_refused_before_any_load() -> None:
    for flags in (["--logprobs", "21"], ["--repetition-penalty", "0"]):
        with pytest.raises(SystemExit):
            cli.parse_args(flags)


def test_multi_turn_workload_sends_each_conversation_with_its_replies(
    synthetic: Server, tmp_path: Path
) -> None:
    r = _run(
        synthetic,
        tmp_path,
        *("--workload", "multi-turn", "--conversations", "3", "--turns", "3"),
        *("--user-len", "5:9", "--system-len", "20", "--output-len", "4", "--concurrency", "2"),
    )
    assert (r["turns"], r["failed"]) == (9, 0)
    rows = r["turn_results"]
    assert [t["conversation"] for t in rows] == [0, 1, 2] * 3
    for c in range(3):
        prompts = [t["prompt_tokens"] for t in rows if t["conversation"] == c]
        assert prompts[0] < prompts[1] < prompts[2]  # each turn carries the ones before
    assert r["prompt_tokens"] == sum(t["prompt_tokens"] for t in rows)
    assert r["cached_tokens"] == sum(t["cached_tokens"] for t in rows)
    assert r["server_counters"]["prefix_cache_queries"] == r["prompt_tokens"]
    assert r["working_set_blocks"] > 0 and r["device_pool_blocks"] > 0


def test_bursts_workload_times_the_streams_and_the_bursts(
    synthetic: Server, tmp_path: Path
) -> None:
    r = _run(
        synthetic,
        tmp_path,
        *("--workload", "bursts", "--streams", "2", "--stream-input-len", "8"),
        *("--bursts", "2", "--burst-size", "2", "--input-len", "40:60", "--quiet-s", "0.2"),
        *("--burst-gap-s", "0", "--burst-output-len", "2"),
    )
    assert r["failed"] == 0 and r["errors"] == []
    assert r["spec"]["burst_input_len"] == [40, 60] and r["spec"]["streams"] == 2
    assert 4 * 40 <= r["burst_prompt_tokens"] <= 4 * 60
    assert r["burst_ttft_s"]["median"] > 0  # every burst prompt answered
