"""A quantized KV cache (--kv-cache-dtype int8 / fp8) served end to end, in process (the real
policy and runner): greedy tokens alone equal those in any batch (chunked prefill, prefix-cache
hits, preemption), and the log-probabilities stay close to transformers' float ones on the
same weights (a tiny Llama with GQA; a tiny Gemma 2 with sliding windows and soft caps).
Under tensor parallelism (real processes, two ranks) int8 KV serves the tokens one rank
serves, through the prefix cache's host and disk tiers, each rank filing its own shard."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from common.messages import SamplingParams
from gpu_worker.kv_cache import bytes_per_block
from gpu_worker.runner.model_runner import ModelRunner
from gpu_worker.runner.options import RunnerOptions
from services.scheduler.policy import PolicyConfig
from tests.engine import LocalEngine
from tests.server import running_server
from tests.tiny_models import make_tiny_model

NUM_NEW = 12
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
# prompt log-probabilities against transformers' (float32 KV), |error| (mean, worst) over
# every position: int8 rows are within 1/254 of their max, fp8 e4m3 within a 16th of each
# value, e5m2 an 8th (the tiny random Gemma 2, 4 layers and soft caps, is the sensitive one)
TOL = {
    "auto": (1e-4, 1e-4),
    "int8": (0.03, 0.1),
    "fp8_e4m3": (0.12, 0.5),
    "fp8_e5m2": (0.25, 1.5),
}


@pytest.fixture(scope="module", params=["llama", "gemma2"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / request.param, request.param)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(3, 49152) for _ in range(20)]  # a prefix several prompts share
    out = [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 37, 18, 60)]
    return out + [shared + [rng.randrange(3, 49152) for _ in range(n)] for n in (3, 11)]


def _runner(tiny: Path, kv: str) -> ModelRunner:
    return ModelRunner(
        str(tiny),
        RunnerOptions(
            block_size=8, num_blocks=96, num_threads=2, kv_cache_dtype=kv, swap_space_gib=0.01
        ),
    )


def _serve(engine: Any, prompts: list[list[int]], sp: SamplingParams = GREEDY) -> list[list[int]]:
    ids = [engine.add(p, sp) for p in prompts]
    out = engine.run()
    return [out[seqs[0]] for seqs in ids]


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_greedy_alone_equals_any_batch(tiny: Path, prompts: list[list[int]], kv: str) -> None:
    runner = _runner(tiny, kv)
    assert runner.kv_cache.tensor.dtype == (torch.int8 if kv == "int8" else torch.uint8)
    assert runner.model_info().kv_cache_dtype == kv
    alone = [
        _serve(LocalEngine(runner, PolicyConfig(), prefix_caching=False), [p])[0] for p in prompts
    ]
    chunked = LocalEngine(runner, PolicyConfig(max_num_batched_tokens=16))
    assert _serve(chunked, prompts) == alone
    hits = chunked.policy.blocks.num_cached_hits
    assert _serve(chunked, prompts) == alone  # again, from the prefix cache
    assert chunked.policy.blocks.num_cached_hits > hits
    # 10 blocks of every layer; gemma2's KV layer groups (windows 0 and 16) hold blocks of
    # one group's layers: 18 hold the longest sequence but preempt (found by driving the
    # policy alone)
    groups = runner.kv_groups
    assert groups is None or groups.windows == (0, 16)
    small = 18 if groups else 10
    tight = LocalEngine(runner, PolicyConfig(watermark=0.0), num_blocks=small, prefix_caching=False)
    assert _serve(tight, prompts) == alone
    assert tight.policy.num_preemptions > 0
    # preempted by swapping: the quantized blocks (their scales inside) to host memory and back
    swapping = LocalEngine(
        runner, PolicyConfig(watermark=0.0, preemption_mode="swap"), num_blocks=small,
        prefix_caching=False,
    )  # fmt: skip
    assert _serve(swapping, prompts) == alone
    assert swapping.policy.num_swaps > 0


@pytest.mark.parametrize("kv", ["auto", "int8", "fp8_e4m3", "fp8_e5m2"])
def test_log_probabilities_close_to_float_kv(tiny: Path, prompts: list[list[int]], kv: str) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    runner = _runner(tiny, kv)
    engine = LocalEngine(runner, PolicyConfig(max_num_batched_tokens=32), overlap=False)
    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, ignore_eos=True)
    rids = [engine.add(p, sp)[0][0] for p in prompts]
    engine.run()
    errors: list[float] = []
    for rid, prompt in zip(rids, prompts, strict=True):
        got = next(
            b.prompt_logprob_values[i]
            for b in engine.batches
            for i, r in enumerate(b.request_ids)
            if r == rid and b.prompt_logprob_token_ids and b.prompt_logprob_token_ids[i]
        )
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([prompt])).logits[0].float()
        ref = torch.log_softmax(logits, -1)
        for pos in range(1, len(prompt)):
            errors.append(abs(got[pos][0] - float(ref[pos - 1, prompt[pos]])))
    mean, worst = sum(errors) / len(errors), max(errors)
    assert mean < TOL[kv][0] and worst < TOL[kv][1], (mean, worst)
    if kv == "int8":  # quantized rows are read, not the float ones
        assert worst > 1e-4


# --- tensor parallelism ---------------------------------------------------------------------
# int8 rows carry a scale per token and KV head, so a rank's shard of a block (its KV heads)
# is quantized exactly as in the whole block: two ranks serve the tokens one rank serves, and
# each rank's tier files hold its shard.

TP_TOKEN = "qkv-tp-admin"
GIB = 1 << 30


def _tp_flags(model: Path, disk: Path, block_bytes: int) -> list[str]:
    return [
        "--model", str(model), "--dtype", "float32", "--kv-cache-dtype", "int8",
        "--tensor-parallel-size", "2", "--admin-token", TP_TOKEN,
        # 12 blocks of 16 slots: a prompt of 7 fits, and the fillers push it out
        "--kv-cache-memory", repr(12 * block_bytes / GIB),
        "--kv-offload-memory", repr(8 * block_bytes / GIB),
        "--kv-offload-dir", str(disk), "--kv-offload-disk", repr(256 * block_bytes / GIB),
    ]  # fmt: skip


def _tp_complete(url: str, model: str, prompt: list[int]) -> tuple[list[int], int]:
    r = httpx.post(
        url + "/v1/completions",
        timeout=300,
        json={
            "model": model,
            "prompt": prompt,
            "max_tokens": NUM_NEW,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    cached = (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return body["choices"][0]["token_ids"], int(cached)


@pytest.mark.slow  # a TP group of its own, ~55 s; TP2 tiers run by default in test_kv_offload
def test_int8_kv_tp2_equals_tp1_and_each_rank_files_its_shard(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    model = make_tiny_model(tmp_path_factory.mktemp("tp") / "llama", "llama")  # 2 KV heads
    rng = random.Random(11)
    long = [rng.randrange(3, 49152) for _ in range(110)]  # 7 blocks: evicted, then back
    fillers = [[rng.randrange(3, 49152) for _ in range(100)] for _ in range(5)]
    others = [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 33, 60)]
    runner = ModelRunner(
        str(model),
        RunnerOptions(block_size=16, num_blocks=96, num_threads=2, kv_cache_dtype="int8"),
    )
    want = {
        tuple(p): _serve(LocalEngine(runner, PolicyConfig(), prefix_caching=False), [p])[0]
        for p in [long, *others]
    }
    # one rank's shard: 2 layers, K and V, 16 slots, 1 KV head, int8 rows of 16 + a scale
    shard = bytes_per_block(2, 16, 1, 16, torch.float32, "int8")
    disk = tmp_path / "kv"
    admin = {"Authorization": f"Bearer {TP_TOKEN}"}
    with running_server(*_tp_flags(model, disk, shard)) as s:
        stats = httpx.get(s.url + "/admin/stats", headers=admin, timeout=30).json()
        assert stats["kv_cache_dtype"] == "int8" and stats["num_total_blocks"] == 12
        for p in others:
            assert _tp_complete(s.url, s.model, p)[0] == want[tuple(p)]
        assert _tp_complete(s.url, s.model, long) == (want[tuple(long)], 0)
        for p in fillers:  # long's blocks leave the pool, then host memory, for disk
            _tp_complete(s.url, s.model, p)
        tokens, cached = _tp_complete(s.url, s.model, long)
        stats = httpx.get(s.url + "/admin/stats", headers=admin, timeout=30).json()
        assert tokens == want[tuple(long)] and cached >= 96
        assert stats["kv_offload_disk_hits"] > 0 and stats["kv_offload_fetch_failures"] == 0
        assert stats["kv_offload_host_bytes"] == stats["kv_offload_host_blocks"] * shard
    names = [sorted(p.name for p in disk.glob(f"worker/rank{r}of2/*.kv")) for r in (0, 1)]
    assert names[0] and names[0] == names[1]  # the same blocks, one shard each
    some = next(disk.glob("worker/rank1of2/*.kv")).read_bytes()
    assert b'"dtype": "int8"' in some and b'"tp_rank": 1' in some
    with running_server(*_tp_flags(model, disk, shard)) as s:  # a restart: from the files
        tokens, cached = _tp_complete(s.url, s.model, long)
        assert tokens == want[tuple(long)] and cached >= 96
