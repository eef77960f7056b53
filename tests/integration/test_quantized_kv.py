"""A quantized KV cache (--kv-cache-dtype int8 / fp8) served end to end, in process (the real
policy and runner): greedy tokens alone equal those in any batch (chunked prefill, prefix-cache
hits, preemption), and the log-probabilities stay close to transformers' float ones on the
same weights (a tiny Llama with GQA; a tiny Gemma 2 with sliding windows and soft caps)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from common.messages import SamplingParams
from gpu_worker.runner.model_runner import ModelRunner
from gpu_worker.runner.options import RunnerOptions
from services.scheduler.policy import PolicyConfig
from tests.engine import LocalEngine
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
    tight = LocalEngine(runner, PolicyConfig(watermark=0.0), num_blocks=10, prefix_caching=False)
    assert _serve(tight, prompts) == alone
    assert tight.policy.num_preemptions > 0
    # preempted by swapping: the quantized blocks (their scales inside) to host memory and back
    swapping = LocalEngine(
        runner, PolicyConfig(watermark=0.0, preemption_mode="swap"), num_blocks=10,
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
