"""vLLM's allowed_token_ids on the worker's logits controls (gpu_worker/sample/logits_controls.py):
every other token is -inf, in rows that ask, and the rows beside them are untouched; the
real sampler then draws only allowed tokens, greedy or not."""

from __future__ import annotations

import dataclasses

import torch

from common.messages.types import SamplingParams
from gpu_worker.sample.logits_controls import History, TokenCounts, apply_controls
from gpu_worker.sample.sampling import sample

VOCAB = 32
CPU = torch.device("cpu")


@dataclasses.dataclass
class _Row:
    req_id: str
    token_ids: list[int]
    num_prompt: int
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)


def test_only_allowed_tokens_keep_their_logits() -> None:
    logits = torch.randn(3, VOCAB)
    params = [
        SamplingParams(allowed_token_ids=[3, 30]),
        SamplingParams(),
        SamplingParams(allowed_token_ids=[5], logit_bias_token_ids=[5], logit_bias_values=[1.0]),
    ]
    rows = [_Row(f"r{i}", [1, 2], 2) for i in range(3)]
    out = apply_controls(logits, params, History(rows, TokenCounts(VOCAB, CPU)))
    finite = [torch.isfinite(out[r]).nonzero().flatten().tolist() for r in range(3)]
    assert finite == [[3, 30], list(range(VOCAB)), [5]]
    assert torch.equal(out[0, [3, 30]], logits[0, [3, 30]])
    assert torch.equal(out[1], logits[1])
    assert out[2, 5] == logits[2, 5] + 1.0  # (and logit_bias after)


def test_sampling_draws_only_allowed_tokens() -> None:
    allowed = [4, 9, 17]
    params = [
        SamplingParams(temperature=1.0, seed=s, allowed_token_ids=allowed) for s in range(8)
    ] + [SamplingParams(temperature=0.0, allowed_token_ids=allowed)]
    rows = [_Row(f"r{i}", [1], 1) for i in range(len(params))]
    gens = [torch.Generator().manual_seed(s) for s in range(len(params))]
    logits = torch.randn(len(params), VOCAB) * 4
    tokens = sample(logits, params, gens, History(rows, TokenCounts(VOCAB, CPU)))
    assert set(tokens) <= set(allowed)
    assert tokens[-1] == max(allowed, key=lambda t: float(logits[-1, t]))  # greedy


def test_controls_no_token_satisfies_leave_the_row_its_logits_and_the_step_samples() -> None:
    """allowed_token_ids = the stop token, banned by min_tokens: no finite logit is left.
    The row keeps its model logits for the step (a sampled row's NaN probabilities would
    fail every request of the step); the row beside it keeps its own controls."""
    params = [
        SamplingParams(temperature=1.0, seed=1, allowed_token_ids=[7], min_tokens=3),
        SamplingParams(temperature=1.0, seed=2, allowed_token_ids=[4, 9]),
    ]
    rows = [_Row("stuck", [1, 2], 2, stop_token_ids=[7]), _Row("fine", [1, 2], 2)]
    logits = torch.randn(2, VOCAB)
    out = apply_controls(logits, params, History(rows, TokenCounts(VOCAB, CPU)))
    assert torch.equal(out[0], logits[0])
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [4, 9]
    gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
    tokens = sample(logits, params, gens, History(rows, TokenCounts(VOCAB, CPU)))
    assert tokens[1] in (4, 9)


def test_a_repetition_penalty_that_rounds_to_zero_in_float32_makes_no_nan() -> None:
    """5e-324 is a valid repetition penalty (> 0) and 0.0 in float32: seen tokens, masked
    ones among them (-inf), must not become NaN (schemathesis found a 500 there)."""
    params = [
        SamplingParams(temperature=1.0, seed=3, repetition_penalty=5e-324, allowed_token_ids=[2, 5])
    ]
    rows = [_Row("r", [2, 3, 5], 1)]  # 3 (masked) and 5 (allowed) were generated
    logits = torch.randn(1, VOCAB)
    out = apply_controls(logits, params, History(rows, TokenCounts(VOCAB, CPU)))
    assert not torch.isnan(out).any()
    gens = [torch.Generator().manual_seed(3)]
    assert sample(logits, params, gens, History(rows, TokenCounts(VOCAB, CPU)))[0] in (2, 5)
