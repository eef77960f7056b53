"""Tensor parallelism on the real processes (--tensor-parallel-size N: N worker ranks over
gloo). Greedy tokens equal transformers' through batching, chunked prefill, prefix hits and
preemption; cancellation and hot-swap (overlap and drain) reach every rank; a killed rank
takes its group down, the supervisor restarts it, requests in flight get the retryable 503
and no KV block leaks. Phi-3, whose checkpoint fuses q/k/v and gate/up, splits part by part.
One server per configuration serves many checks."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import orjson
import pytest
from transformers import AutoTokenizer

from common.prepare_model import prepare_default_model
from tests.reference import hf_greedy
from tests.server import REPO, Server, running_server
from tests.tiny_models import make_tiny_model
from tests.waiting import wait_until

TOKEN = "tp-admin"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
NUM_NEW = 24
TINY_BLOCK_BYTES = 2 * 2 * 16 * 1 * 16 * 4  # tiny llama, per rank: layers, K/V, slots, 1 KV head


def _gib(num_blocks: int, block_bytes: int) -> str:
    return repr(num_blocks * block_bytes / (1 << 30))


def _prompts(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49000) for _ in range(n)] for n in lengths]


def _complete(server: Server, prompt: list[int] | list[list[int]], num_new: int = NUM_NEW) -> dict:
    r = httpx.post(
        server.url + "/v1/completions",
        timeout=600,
        json={
            "model": server.model,
            "prompt": prompt,
            "max_tokens": num_new,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    assert r.status_code == 200, r.text
    return r.json()


def _tokens(server: Server, prompt: list[int], num_new: int = NUM_NEW) -> list[int]:
    return _complete(server, prompt, num_new)["choices"][0]["token_ids"]


def _together(server: Server, prompts: list[list[int]], num_new: int = NUM_NEW) -> list[list[int]]:
    """All prompts in one request (a batch of prompts): they reach the scheduler together
    however busy the machine is, so the small pool must preempt."""
    choices = _complete(server, prompts, num_new)["choices"]
    return [c["token_ids"] for c in sorted(choices, key=lambda c: c["index"])]


def _stats(server: Server) -> dict:
    return httpx.get(server.url + "/admin/stats", headers=ADMIN, timeout=30).json()


def _idle(server: Server) -> bool:
    s = _stats(server)
    return s.get("ready", False) and s["num_used_blocks"] == 0 and s["num_running"] == 0


def _check_parity_everywhere(server: Server, prompts: list[list[int]], expected: list) -> None:
    """Batched under a tiny pool (preemption), chunked (small budget), alone, and one prompt
    twice (a prefix hit): every output equals the reference."""
    before = _stats(server)
    assert _together(server, prompts) == expected
    assert _stats(server)["num_preemptions"] > before["num_preemptions"]
    assert [_tokens(server, p) for p in prompts] == expected
    hits = _stats(server)["prefix_cache_hits"]
    assert _tokens(server, prompts[-1]) == expected[-1]
    assert _stats(server)["prefix_cache_hits"] > hits
    wait_until(lambda: _idle(server), 60, "every block free")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("tp-models")
    return {
        "a": make_tiny_model(root / "tiny-a", "llama", seed=1),  # 4 heads, 2 KV heads
        "b": make_tiny_model(root / "tiny-b", "llama", seed=2),  # the same layout
        "root": root,
    }


def test_tp2_tiny_llama_equals_transformers(tiny: dict[str, Path]) -> None:
    prompts = _prompts((5, 17, 30, 41, 50, 60))
    expected = [hf_greedy(tiny["a"], p, NUM_NEW) for p in prompts]
    flags = ["--model", str(tiny["a"]), "--tensor-parallel-size", "2", "--admin-token", TOKEN]
    # a 24-token budget chunks every prompt over 5; 14 blocks cannot hold them all: preemption
    flags += ["--max-num-batched-tokens", "24", "--kv-cache-memory", _gib(14, TINY_BLOCK_BYTES)]
    flags += ["--speculative", "ngram"]  # drafts verified on every rank alike
    with running_server(*flags) as server:
        assert _stats(server)["num_total_blocks"] == 14
        assert server.logs().count('"rank 1 ready"') == 1
        _check_parity_everywhere(server, prompts, expected)
        assert _stats(server)["spec_num_draft_tokens"] > 0


@pytest.mark.slow
def test_tp2_tiny_phi3_equals_transformers(tmp_path: Path) -> None:
    """Phi-3's checkpoint fuses q/k/v and gate/up: each rank reads its share of every part
    (gpu_worker/distributed/sharding.fused_ranges); a window of 15 the prompts cross. Slow
    (a TP group of its own, ~80 s on 2 cores): the split itself is unit-tested beside
    fused_ranges, and test_tp2_tiny_llama_equals_transformers runs TP in the default set."""
    phi3 = make_tiny_model(tmp_path / "phi3", "phi3")  # 4 heads, 4 KV heads
    prompts = _prompts((5, 17, 41, 60))
    expected = [hf_greedy(phi3, p, NUM_NEW) for p in prompts]
    flags = ["--model", str(phi3), "--tensor-parallel-size", "2", "--admin-token", TOKEN]
    with running_server(*flags, "--max-num-batched-tokens", "24") as server:
        assert _together(server, prompts) == expected
        assert [_tokens(server, p) for p in prompts] == expected


@pytest.fixture(scope="module")
def tp_server(tiny: dict[str, Path]):  # type: ignore[no-untyped-def]
    flags = ["--model", str(tiny["a"]), "--tensor-parallel-size", "2", "--admin-token", TOKEN]
    with running_server(*flags, "--model-root", str(tiny["root"])) as s:
        yield s


def _stream(server: Server, rid: str, max_tokens: int, out: dict[str, str]) -> None:
    body = {
        "model": server.model,
        "prompt": "Tell me a long story:",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    outcome = "no end"
    headers = {"X-Request-Id": rid}
    with httpx.stream(
        "POST", server.url + "/v1/completions", json=body, timeout=300, headers=headers
    ) as r:
        if r.status_code != 200:
            out[rid] = f"error {r.status_code}"
            return
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = orjson.loads(line[6:])
                if "error" in chunk:
                    outcome = f"error {chunk['error']['code']}"
                elif chunk["choices"] and chunk["choices"][0].get("finish_reason"):
                    outcome = chunk["choices"][0]["finish_reason"]
    out[rid] = outcome


def _in_state(server: Server, state: str) -> set[str]:
    rows = httpx.get(server.url + "/admin/requests", headers=ADMIN, timeout=30).json()
    return {r["id"] for r in rows["requests"] if r["state"] == state}


def _start_streams(server: Server, rids: list[str], out: dict[str, str]) -> list[threading.Thread]:
    threads = [
        threading.Thread(target=_stream, args=(server, rid, 900, out), daemon=True) for rid in rids
    ]
    for t in threads:
        t.start()
    wait_until(lambda: set(rids) <= _in_state(server, "decoding"), 120, f"{rids} decoding")
    return threads


def test_tp2_cancel_reaches_every_rank(tp_server: Server, tiny: dict[str, Path]) -> None:
    out: dict[str, str] = {}
    threads = _start_streams(tp_server, ["tp-cancel", "tp-keep"], out)
    r = httpx.post(f"{tp_server.url}/admin/cancel/tp-cancel", headers=ADMIN, timeout=30)
    assert r.json()["cancelled"] is True
    threads[0].join(120)
    assert out["tp-cancel"] == "cancelled"
    assert "tp-keep" in _in_state(tp_server, "decoding")  # the other one runs on
    httpx.post(f"{tp_server.url}/admin/cancel/tp-keep", headers=ADMIN, timeout=30)
    threads[1].join(120)
    assert out["tp-keep"] == "cancelled"
    wait_until(lambda: _idle(tp_server), 60, "every block free")
    prompt = _prompts((20,), seed=3)[0]
    assert _tokens(tp_server, prompt) == hf_greedy(tiny["a"], prompt, NUM_NEW)


def _swap(server: Server, model: Path, version: str, mode: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "tools.swap_model", "--model", str(model), "--version", version]
        + ["--mode", mode, "--url", server.url, "--admin-token", TOKEN, "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return orjson.loads(out.stdout)


def test_tp2_hot_swap_overlap_and_drain(tp_server: Server, tiny: dict[str, Path]) -> None:
    prompt = _prompts((33,), seed=4)[0]
    for model, version, mode in ((tiny["b"], "v-b", "overlap"), (tiny["a"], "v-a", "drain")):
        result = _swap(tp_server, model, version, mode)
        assert result["ok"] and result["version"] == version, result
        body = _complete(tp_server, prompt)
        assert body["system_fingerprint"] == version
        assert body["choices"][0]["token_ids"] == hf_greedy(model, prompt, NUM_NEW)
    wait_until(lambda: _idle(tp_server), 60, "every block free")


def _rank_pid(server: Server, rank: int) -> int:
    for _, pid in server.children():
        argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
        if "--rank" in argv and argv[argv.index("--rank") + 1] == str(rank):
            return pid
    raise AssertionError(f"no rank {rank} among {server.children()}")


def test_tp2_killed_rank_restarts_the_group(tp_server: Server, tiny: dict[str, Path]) -> None:
    wait_until(tp_server.serves, 120, "a completion to succeed")
    rank0, rank1 = _rank_pid(tp_server, 0), _rank_pid(tp_server, 1)
    out: dict[str, str] = {}
    rids = [f"tp-kill-{i}" for i in range(4)]
    threads = _start_streams(tp_server, rids, out)
    os.kill(rank1, signal.SIGKILL)
    for t in threads:
        t.join(300)
    # 900 tokens each: the streams paused while the group restarted, were sent again with
    # the tokens already streamed (the gateway's resume) and ran to their length
    assert out == {rid: "length" for rid in rids}
    wait_until(tp_server.serves, 120, "serving again")
    assert {_rank_pid(tp_server, 0), _rank_pid(tp_server, 1)}.isdisjoint({rank0, rank1})
    wait_until(lambda: _idle(tp_server), 60, "every block free, nothing running")
    stats = _stats(tp_server)
    # nothing leaked: every block free (a free count that includes the resumed streams'
    # cached prefix blocks, which nobody holds)
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    prompt = _prompts((25,), seed=5)[0]
    # after the restart the group serves the start-up model again
    assert _tokens(tp_server, prompt) == hf_greedy(tiny["a"], prompt, NUM_NEW)


SMOL_TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a village at the edge of a dark forest, there lived an old "
    "clockmaker who",
    " ".join(f"item {i}," for i in range(40)),
]


@pytest.fixture(scope="module")
def smol() -> tuple[Path, list[list[int]]]:
    path = prepare_default_model()
    tok = AutoTokenizer.from_pretrained(path)
    return path, [tok.encode(t) for t in SMOL_TEXTS]


def test_tp3_default_model_batched_and_chunked(smol: tuple[Path, list[list[int]]]) -> None:
    path, prompts = smol[0], smol[1][:3]  # (the long one is for the slow variant)
    num_new = 12
    expected = [hf_greedy(path, p, num_new) for p in prompts]
    flags = ("--tensor-parallel-size", "3", "--max-num-batched-tokens", "8")
    with running_server(*flags) as server:
        assert _together(server, prompts, num_new) == expected


@pytest.mark.slow
def test_tp3_default_model_everywhere(smol: tuple[Path, list[list[int]]]) -> None:
    path, prompts = smol
    expected = [hf_greedy(path, p, NUM_NEW) for p in prompts]
    # SmolLM2 per rank: 30 layers, K/V, 16 slots, 1 KV head of 64, fp32
    block_bytes = 30 * 2 * 16 * 1 * 64 * 4
    flags = ["--tensor-parallel-size", "3", "--admin-token", TOKEN]
    flags += ["--max-num-batched-tokens", "32", "--kv-cache-memory", _gib(16, block_bytes)]
    with running_server(*flags) as server:
        _check_parity_everywhere(server, prompts, expected)


@pytest.mark.slow
def test_tp2_ranks_on_a_second_host_join_through_worker_ranks(
    tiny: dict[str, Path], tmp_path: Path
) -> None:
    """`shuttle worker-ranks` runs "host B"'s rank (both hosts are this one, on loopback)."""
    from services.worker_group import free_loopback_addr

    addr = free_loopback_addr()
    group = ["--tensor-parallel-size", "2", "--nnodes", "2", "--dist-init-addr", addr]
    group += ["--model", str(tiny["a"])]
    host_b = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "worker-ranks", *group, "--node-rank", "1"]
        + ["--run-dir", str(tmp_path / "host-b")],
        cwd=REPO,
        start_new_session=True,
    )
    try:
        with running_server(*group, "--node-rank", "0") as server:
            assert [name for name, _ in server.children()].count("gpu_worker") == 1
            prompt = _prompts((21,), seed=6)[0]
            assert _tokens(server, prompt) == hf_greedy(tiny["a"], prompt, NUM_NEW)
    finally:
        host_b.send_signal(signal.SIGTERM)
        host_b.wait(30)
