"""Greedy parity with transformers for models with sliding-window layers, through the real
scheduling policy and runner in this process: prompts that cross the window several times,
alone and in one batch with chunked prefill, prefix-cache hits, n > 1 forks and preemption,
with the KV layer groups (common/kv_groups.py) releasing the blocks out of each window.

    mistral-window  every layer slides over 16 positions (Mistral's sliding_window)
    qwen2-window    the second layer slides over 8 (use_sliding_window, max_window_layers 1)
    gemma2          layers alternate sliding over 16 and full; soft caps, sandwich norms
    gemma3          5 sliding layers (16, local rope) : 1 full (linear-scaled rope)
"""

from __future__ import annotations

import pytest
import torch

from common.kv_groups import blocks_held
from common.messages import SamplingParams
from gpu_worker.runner.model_runner import ModelRunner
from gpu_worker.runner.options import RunnerOptions
from services.scheduler.engine_view import stats
from services.scheduler.grouped_blocks import GroupedBlockManager
from services.scheduler.policy import PolicyConfig
from tests.engine import LocalEngine
from tests.reference import hf_greedy
from tests.tiny_models import VOCAB_SIZE, make_tiny_model

torch.set_num_threads(2)

NUM_NEW = 24
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
SHARED = 40  # a common prefix of 40 tokens: whole blocks of it hit the prefix cache


@pytest.fixture(scope="module", params=["mistral-window", "qwen2-window", "gemma2", "gemma3"])
def model(request, tmp_path_factory) -> tuple[str, list[list[int]], list[list[int]]]:
    path = make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(3, VOCAB_SIZE, (SHARED,), generator=gen).tolist()
    tails = [torch.randint(3, VOCAB_SIZE, (n,), generator=gen).tolist() for n in (3, 20, 61)]
    singles = [torch.randint(3, VOCAB_SIZE, (n,), generator=gen).tolist() for n in (1, 15, 90)]
    prompts = [shared + t for t in tails] + singles
    return str(path), prompts, [hf_greedy(path, p, NUM_NEW) for p in prompts]


def _serve(engine, prompts: list[list[int]], sp: SamplingParams = GREEDY):  # type: ignore[no-untyped-def]
    ids = [engine.add(p, sp) for p in prompts]
    out = engine.run()
    return [[out[s] for s in seqs] for seqs in ids]


def _runner(path: str) -> ModelRunner:
    options = RunnerOptions(block_size=4, num_blocks=512, num_threads=2, swap_space_gib=0.01)
    return ModelRunner(path, options)


def test_alone_then_batched_in_chunks_then_from_the_prefix_cache(model) -> None:
    path, prompts, expected = model
    runner = _runner(path)
    for prompt, exp in zip(prompts, expected, strict=True):  # alone, each in a fresh engine
        engine = LocalEngine(runner, PolicyConfig(max_num_batched_tokens=256))
        assert _serve(engine, [prompt])[0][0] == exp
    # one batch, prefills cut into chunks of at most 13 tokens beside the decodes
    engine = LocalEngine(runner, PolicyConfig(max_num_batched_tokens=13))
    assert [o[0] for o in _serve(engine, prompts)] == expected
    blocks = engine.policy.blocks
    assert isinstance(blocks, GroupedBlockManager) and blocks.num_released > 0
    shown = stats(engine.core)  # /admin/stats: blocks per group (all cached now, none used)
    assert [g["window"] for g in shown["kv_groups"]] == list(blocks.windows)
    assert sum(g["num_used_blocks"] for g in shown["kv_groups"]) == 0
    assert shown["kv_released_blocks"] == blocks.num_released
    hits = engine.policy.blocks.num_cached_hits
    assert [o[0] for o in _serve(engine, prompts)] == expected  # again: from the cache
    assert engine.policy.blocks.num_cached_hits - hits >= sum(len(p) for p in prompts) // 2


def test_n_forks_and_preemption_keep_outputs(model, request) -> None:
    path, prompts, expected = model
    arch = request.node.callspec.params["model"]
    runner = _runner(path)
    sp = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, n=2)
    engine = LocalEngine(runner, PolicyConfig(max_num_batched_tokens=64), prefix_caching=False)
    assert _serve(engine, prompts[:3], sp) == [[e, e] for e in expected[:3]]
    # a pool (a block holds one layer group's layers) that holds the longest sequence,
    # 101 + 24 tokens in chunks of 64, but not all of them: a running sequence is preempted
    # as the global layers' tables grow (sizes found by driving the policy alone); where
    # every layer slides (Mistral) a sequence holds its window only, never grows, and waits
    assert runner.kv_groups is not None
    groups = runner.kv_groups
    longest = blocks_held(groups.windows, 4, 125, 64)
    num_blocks = {"qwen2-window": 80, "gemma2": 90, "gemma3": 190}.get(arch, longest)
    assert num_blocks >= longest
    engine = LocalEngine(
        runner,
        PolicyConfig(max_num_batched_tokens=64, watermark=0.0),
        num_blocks=num_blocks,
        prefix_caching=False,
    )
    assert [o[0] for o in _serve(engine, prompts)] == expected
    assert engine.policy.num_preemptions > 0 or all(groups.windows)
    assert engine.policy.blocks.num_released > 0
    # the same, preempted by swapping each group's blocks out and back in
    engine = LocalEngine(
        runner,
        PolicyConfig(max_num_batched_tokens=64, watermark=0.0, preemption_mode="swap"),
        num_blocks=num_blocks,
        prefix_caching=False,
    )
    assert [o[0] for o in _serve(engine, prompts)] == expected
    assert engine.policy.num_swaps > 0 or all(groups.windows)


def test_ngram_speculation_trims_every_group(model) -> None:
    """Drafts (prompt lookup) verified in the step: rejected drafts' blocks leave every
    group's table, on both sides, and the tokens stay transformers'."""
    path, prompts, expected = model
    options = RunnerOptions(
        block_size=4, num_blocks=512, num_threads=2, speculative="ngram", prompt_lookup_min=1
    )
    runner = ModelRunner(path, options)
    engine = LocalEngine(runner, PolicyConfig(max_num_batched_tokens=32, num_speculative_tokens=3))
    assert [o[0] for o in _serve(engine, prompts)] == expected
    assert engine.policy.num_spec_rounds > 0 and engine.policy.blocks.num_released > 0
