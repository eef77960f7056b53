"""Greedy parity with transformers through every scheduling feature: prefix-cache hits,
n > 1 forks with copy-on-write, and a KV pool so small that preemption happens (recompute
and swap), with and without overlapped scheduling. In-process: real policy, real runner."""

from __future__ import annotations

import functools

import pytest
from transformers import AutoTokenizer

from common.messages import SamplingParams
from common.prepare_model import prepare_default_model
from gpu_worker.runner.model_runner import ModelRunner
from gpu_worker.runner.options import RunnerOptions
from services.scheduler.policy import PolicyConfig
from tests.engine import LocalEngine
from tests.reference import hf_greedy

NUM_NEW = 32
SYSTEM = ("You are a careful assistant. Answer briefly, cite facts, and never invent sources. ") * 4
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "List three primary colours:\n1.",
    "Once upon a time, in a village at the edge of a dark forest, there lived an old man who",
    SYSTEM + "Question: what is the boiling point of water?",
    SYSTEM + "Question: who wrote Hamlet?",
    " ".join(f"item {i}," for i in range(40)),
    "Explain how a refrigerator keeps food cold. " * 5,
]
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir():  # type: ignore[no-untyped-def]
    return str(prepare_default_model())


@pytest.fixture(scope="module")
def prompts(model_dir: str) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def expected(model_dir: str, prompts: list[list[int]]) -> list[list[int]]:
    return [_reference(model_dir, tuple(p)) for p in prompts]


@functools.lru_cache(maxsize=64)
def _reference(model_dir: str, prompt: tuple[int, ...]) -> list[int]:
    return hf_greedy(model_dir, list(prompt), NUM_NEW)


@pytest.fixture(scope="module")
def runner(model_dir: str) -> ModelRunner:
    options = RunnerOptions(
        block_size=16, kv_cache_memory_gib=0.25, num_threads=2, swap_space_gib=0.25
    )
    return ModelRunner(model_dir, options)


def _engine(runner: ModelRunner, **kw) -> LocalEngine:  # type: ignore[no-untyped-def]
    policy = {k: kw.pop(k) for k in list(kw) if k in PolicyConfig.__dataclass_fields__}
    return LocalEngine(runner, PolicyConfig(**{"max_num_batched_tokens": 256, **policy}), **kw)


def _serve(
    engine: LocalEngine, prompts: list[list[int]], sp: SamplingParams = GREEDY
) -> list[list[list[int]]]:
    ids = [engine.add(p, sp) for p in prompts]
    out = engine.run()
    return [[out[s] for s in seqs] for seqs in ids]


@pytest.mark.parametrize("overlap", [True, False])
def test_prefix_hits_keep_outputs_and_skip_the_cached_prompt(
    runner, prompts, expected, overlap: bool
) -> None:
    engine = _engine(runner, overlap=overlap)
    first = _serve(engine, prompts)
    assert [o[0] for o in first] == expected
    computed = engine.policy.num_computed_tokens_total
    hits_before = engine.policy.blocks.num_cached_hits
    again = _serve(engine, prompts)
    assert [o[0] for o in again] == expected
    second = engine.policy.num_computed_tokens_total - computed
    # the second pass computes only the uncached tails: far fewer prompt tokens
    total_prompt = sum(len(p) for p in prompts)
    assert engine.policy.blocks.num_cached_hits - hits_before >= total_prompt // 2
    assert second < (total_prompt + len(prompts) * NUM_NEW) - total_prompt // 2


def test_shared_system_prompt_hits_across_requests(runner, prompts, expected) -> None:
    engine = _engine(runner)
    _serve(engine, [prompts[4]])
    before = engine.policy.num_computed_tokens_total
    assert _serve(engine, [prompts[5]])[0][0] == expected[5]
    tail = engine.policy.num_computed_tokens_total - before
    shared = (len(AutoTokenizer.from_pretrained(runner.model_path).encode(SYSTEM)) // 16) * 16
    assert tail <= len(prompts[5]) - shared + NUM_NEW


def test_a_new_model_version_gets_no_hits(runner, prompts) -> None:
    engine = _engine(runner)
    _serve(engine, prompts[:2])
    old = runner.default_version
    runner.relabel("another-version")  # what a swap to other weights does to new requests
    try:
        engine.core.adopt(runner.model_info())
        hits = engine.policy.blocks.num_cached_hits
        _serve(engine, prompts[:2])
        assert engine.policy.blocks.num_cached_hits == hits
    finally:
        runner.relabel(old)


@pytest.mark.parametrize("overlap", [True, False])
def test_n_sequences_share_the_prompt_and_each_equals_single(
    runner, prompts, expected, overlap: bool
) -> None:
    engine = _engine(runner, overlap=overlap, prefix_caching=False)
    sp = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, n=3)
    out = _serve(engine, prompts[:4], sp)
    for seqs, exp in zip(out, expected[:4], strict=True):
        assert seqs == [exp, exp, exp]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("overlap", [True, False])
def test_preemption_keeps_outputs(runner, prompts, expected, mode: str, overlap: bool) -> None:
    # 30 blocks of 16 tokens for 8 requests of up to ~170 + 32 tokens: they cannot all fit
    engine = _engine(
        runner,
        num_blocks=30,
        num_host_blocks=60,
        overlap=overlap,
        preemption_mode=mode,
        watermark=0.0,
        prefix_caching=False,
    )
    out = _serve(engine, prompts)
    assert [o[0] for o in out] == expected
    assert engine.policy.num_preemptions > 0
    if mode == "swap":
        assert engine.policy.num_swaps > 0
