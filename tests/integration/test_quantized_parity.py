"""Greedy tokens of quantized models do not depend on how they are served: the default
model's own Q4_1 GGUF file served as it is, and the float model quantized to int8 W8A8 at
load, give each prompt the same tokens alone as in a batch with chunked prefill, prefix-cache
hits, preemption and n-gram speculation. Activations are quantized per row, so a row's
result is the same whatever else is in the step (gpu_worker/layers/linear_methods/).

In-process: the real policy and the real runner, with the CPU kernels the worker uses."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from common.messages import SamplingParams
from common.prepare_model import prepare_default_model
from gpu_worker.layers.linear_methods.gguf import GGUFLinearMethod
from gpu_worker.layers.linear_methods.int8 import Int8LinearMethod
from gpu_worker.runner.model_runner import ModelRunner
from gpu_worker.runner.options import RunnerOptions
from services.scheduler.policy import PolicyConfig
from tests.engine import LocalEngine
from tests.gguf_models import default_gguf_file

NUM_NEW = 24
SYSTEM = "You are a careful assistant. Answer briefly and never invent sources. " * 3
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    SYSTEM + "Question: what is the boiling point of water?",
    SYSTEM + "Question: who wrote Hamlet?",
    " ".join(f"item {i}," for i in range(30)),
    "Explain how a refrigerator keeps food cold. " * 4,
]
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["gguf-q4_1", "int8"])
def runner(request: pytest.FixtureRequest) -> ModelRunner:
    kw = dict(block_size=16, kv_cache_memory_gib=0.25, num_threads=2, swap_space_gib=0.25)
    if request.param == "int8":
        r = ModelRunner(str(prepare_default_model()), RunnerOptions(quantization="int8", **kw))  # type: ignore[arg-type]
        method: type = Int8LinearMethod
    else:
        r = ModelRunner(str(default_gguf_file()), RunnerOptions(**kw))  # type: ignore[arg-type]
        method = GGUFLinearMethod
    assert all(
        isinstance(m.method, method) for _, m in r.model.linears() if m is not r.model.lm_head
    )
    return r


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(prepare_default_model())
    return [tok.encode(t) for t in TEXTS]


def _engine(runner: ModelRunner, **kw) -> LocalEngine:  # type: ignore[no-untyped-def]
    policy = {k: kw.pop(k) for k in list(kw) if k in PolicyConfig.__dataclass_fields__}
    return LocalEngine(runner, PolicyConfig(**{"max_num_batched_tokens": 512, **policy}), **kw)


def _serve(
    engine: LocalEngine, prompts: list[list[int]], sp: SamplingParams = GREEDY
) -> list[list[int]]:
    ids = [engine.add(p, sp) for p in prompts]
    out = engine.run()
    return [out[seqs[0]] for seqs in ids]


@pytest.fixture(scope="module")
def alone(runner: ModelRunner, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt served by itself: one sequence a step, its prompt in one chunk."""
    return [_serve(_engine(runner, prefix_caching=False), [p])[0] for p in prompts]


def test_a_batch_with_chunked_prefill_and_prefix_hits_gives_the_tokens_alone(
    runner: ModelRunner, prompts: list[list[int]], alone: list[list[int]]
) -> None:
    engine = _engine(runner, max_num_batched_tokens=64)  # prompts cut into chunks
    assert _serve(engine, prompts) == alone
    hits = engine.policy.blocks.num_cached_hits
    assert _serve(engine, prompts) == alone  # again: the prompts' blocks come from the cache
    assert engine.policy.blocks.num_cached_hits > hits


def test_preemption_keeps_the_tokens(
    runner: ModelRunner, prompts: list[list[int]], alone: list[list[int]]
) -> None:
    engine = _engine(
        runner, num_blocks=12, watermark=0.0, prefix_caching=False, preemption_mode="recompute"
    )
    assert _serve(engine, prompts) == alone
    assert engine.policy.num_preemptions > 0


def test_ngram_speculation_keeps_the_tokens(
    runner: ModelRunner, prompts: list[list[int]], alone: list[list[int]]
) -> None:
    spec = ModelRunner(
        runner.model_path,
        RunnerOptions(
            block_size=16,
            kv_cache_memory_gib=0.25,
            num_threads=2,
            quantization=runner.options.quantization,
            speculative="ngram",
            prompt_lookup_min=1,
            prompt_lookup_max=3,
        ),
    )
    engine = LocalEngine(spec, PolicyConfig(num_speculative_tokens=3), overlap=False)
    assert _serve(engine, prompts) == alone
    assert engine.policy.num_draft_tokens > 0 and engine.policy.num_accepted_tokens > 0
