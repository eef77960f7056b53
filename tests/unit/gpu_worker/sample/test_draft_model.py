"""The draft model's KV pool (DraftModel, gpu_worker/sample/speculative.py) under blocks whose
target KV arrived without it: a prefix hit, a block read up from the KV tiers, or one
imported by a prefill/decode hand-over, all of which carry the target's KV only. The draft
never reads its pool for such blocks: a sequence starts with `draft_computed` 0 and the
draft computes its KV from the tokens at its first proposal. With the target as its own
draft (greedy), a draft that read a wrong KV would be rejected, so "every draft accepted"
after the draft pool was filled with garbage proves it."""

from __future__ import annotations

import pytest
import torch

from common.messages import SamplingParams
from gpu_worker.runner.model_runner import ModelRunner
from gpu_worker.runner.options import RunnerOptions
from services.scheduler.policy import PolicyConfig
from tests.engine import LocalEngine
from tests.tiny_models import make_tiny_model

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    model = str(make_tiny_model(tmp_path_factory.mktemp("draft") / "tiny", "llama", seed=1))
    options = RunnerOptions(block_size=4, num_blocks=64, speculative="draft", draft_model=model)
    return ModelRunner(model, options)


def test_the_draft_computes_its_kv_of_blocks_it_finds_cached(runner: ModelRunner) -> None:
    engine = LocalEngine(
        runner, PolicyConfig(max_num_seqs=4, num_speculative_tokens=3), overlap=False
    )
    prompt = list(range(5, 23))  # 18 tokens: 4 full blocks of 4 and a tail
    (first,) = engine.add(prompt, GREEDY)
    expected = engine.run()[first]
    policy, blocks = engine.policy, engine.policy.blocks
    assert policy.num_accepted_tokens == policy.num_draft_tokens > 0  # the target drafts itself
    assert runner.drafter is not None
    pool = runner.drafter.kv_cache.tensor
    garbage = torch.randn(pool.shape, generator=torch.Generator().manual_seed(0)) * 100
    pool.copy_(garbage.to(pool.dtype))  # as a hand-over leaves it: the target's KV only
    hits, drafted = blocks.num_cached_hits, policy.num_draft_tokens
    (second,) = engine.add(prompt, GREEDY)
    assert engine.run()[second] == expected
    assert blocks.num_cached_hits >= hits + 4  # its prompt's full blocks were prefix hits
    assert policy.num_draft_tokens > drafted
    assert policy.num_accepted_tokens == policy.num_draft_tokens  # none read the garbage
