"""Speculative decoding's pure parts: n-gram drafting, the acceptance rule, the scheduler's
draft slots and their rollback."""

from __future__ import annotations

import pytest
import torch

from common.messages import SamplingParams
from gpu_worker.sample.speculative import ngram_propose, verify
from services.scheduler.block_manager import BlockManager
from services.scheduler.policy import PolicyConfig, SchedulingPolicy
from services.scheduler.request import Request

# chi-square critical values at alpha = 0.001 by degrees of freedom
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over the cells with expected count >= 5 (the rest pooled)."""
    n = float(counts.sum())
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big].float(), counts[~big].sum()[None].float()])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return stat, int(keep.sum()) - 1


# --- n-gram drafting --------------------------------------------------------------------------
def test_ngram_continues_the_latest_earlier_occurrence_of_the_longest_suffix() -> None:
    # "... 5 6 7 | 8 9 ... 5 6 7 | 1 2 ... 5 6 7": the latest earlier "5 6 7" is followed by 1 2
    tokens = [5, 6, 7, 8, 9, 0, 5, 6, 7, 1, 2, 3, 5, 6, 7]
    assert ngram_propose(tokens, 2, 1, 3) == [1, 2]
    assert ngram_propose(tokens, 5, 1, 3) == [1, 2, 3, 5, 6]


def test_ngram_prefers_longer_suffixes_and_falls_back_to_shorter_ones() -> None:
    tokens = [1, 2, 3, 9, 2, 3, 4, 7, 3]  # "2 3" never ends the context, "3" does
    assert ngram_propose(tokens, 1, 1, 3) == [4]  # the latest earlier "3" is followed by 4
    assert ngram_propose(tokens, 1, 2, 3) == []  # "7 3" never occurred before
    assert ngram_propose([1, 2, 3, 4], 3, 1, 4) == []  # no repeat at all
    assert ngram_propose([4, 4], 3, 1, 2) == [4]  # the match runs into the suffix itself


def test_ngram_drafts_stop_at_the_end_of_the_context() -> None:
    assert ngram_propose([1, 2, 1], 4, 1, 1) == [2, 1]
    assert ngram_propose([], 4, 1, 3) == [] and ngram_propose([3], 4, 1, 3) == []


# --- the acceptance rule ----------------------------------------------------------------------
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def _logits_with_argmax(tokens: list[int], vocab: int = 10) -> torch.Tensor:
    logits = torch.zeros(len(tokens), vocab)
    for row, t in enumerate(tokens):
        logits[row, t] = 5.0
    return logits


@pytest.mark.parametrize(
    "drafts, target, expect, accepted",
    [
        ([3, 4, 5], [3, 4, 5, 6], [3, 4, 5, 6], 3),  # all accepted, plus the bonus token
        ([3, 4, 5], [3, 9, 5, 6], [3, 9], 1),  # the first mismatch ends it with the target's token
        ([3, 4, 5], [7, 4, 5, 6], [7], 0),
        ([], [2], [2], 0),
    ],
)
def test_greedy_accepts_the_longest_matching_prefix(
    drafts: list[int], target: list[int], expect: list[int], accepted: int
) -> None:
    v = verify(_logits_with_argmax(target), drafts, GREEDY, None)
    assert v.tokens == expect and v.num_accepted == accepted


def _draws(
    p: torch.Tensor, q: torch.Tensor | None, drafts: list[int], n: int, seed: int = 0
) -> list[list[int]]:
    params = SamplingParams(max_tokens=8, temperature=1.0)
    gen = torch.Generator().manual_seed(seed)
    logits = p.log()
    return [verify(logits, drafts, params, gen, q).tokens for _ in range(n)]


def test_sampled_first_token_follows_the_target_whatever_the_draft_model_proposes() -> None:
    """A draft distribution q far from p: the first kept token is still distributed as p[0]
    (rejection sampling), and after an accepted draft the next one as p[1]."""
    torch.manual_seed(1)
    vocab, n = 6, 6000
    p = torch.softmax(torch.randn(3, vocab) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(2, vocab) * 1.5, dim=-1)
    gen = torch.Generator().manual_seed(7)
    firsts, seconds, accepted = [], [], 0
    params = SamplingParams(max_tokens=8, temperature=1.0)
    for _ in range(n):
        # the draft model's proposals are drawn from q, as the drafter would draw them
        d = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(2)]
        v = verify(p.log(), d, params, gen, q)
        firsts.append(v.tokens[0])
        accepted += v.num_accepted
        if len(v.tokens) > 1:
            seconds.append(v.tokens[1])
    for sample, probs in ((firsts, p[0]), (seconds, p[1])):
        counts = torch.bincount(torch.tensor(sample), minlength=vocab)
        stat, df = chi_square(counts, probs)
        assert stat < CHI2_999[df], (stat, df, counts, probs)
    assert 0.2 * n < accepted < 1.8 * n  # both accepting and rejecting happened often


def test_sampled_point_mass_drafts_keep_the_target_distribution() -> None:
    """The n-gram drafter's q is a point mass: accepted with probability p(d), else the
    residual is p without d."""
    torch.manual_seed(2)
    vocab = 5
    p = torch.softmax(torch.randn(2, vocab), dim=-1)
    draft = int(p[0].argmin())  # a draft the target rarely wants
    out = _draws(p, None, [draft], 5000)
    counts = torch.bincount(torch.tensor([t[0] for t in out]), minlength=vocab)
    stat, df = chi_square(counts, p[0])
    assert stat < CHI2_999[df], (stat, counts, p[0])


# --- the scheduler's draft slots --------------------------------------------------------------
def _decoding(
    k: int, num_blocks: int = 32, max_tokens: int = 20
) -> tuple[SchedulingPolicy, Request]:
    s = SchedulingPolicy(BlockManager(num_blocks, 4), PolicyConfig(num_speculative_tokens=k))
    req = Request(
        "r", list(range(100, 106)), SamplingParams(max_tokens=max_tokens, temperature=0.0)
    )
    s.add(req)
    out = s.schedule()  # the prompt: no drafts before the first token
    assert out.scheduled[0].num_spec_tokens == 0
    s.update(["r"], [7])
    return s, req


def test_decode_gets_draft_slots_and_rejected_slots_are_released() -> None:
    s, req = _decoding(k=4)
    out = s.schedule()
    sch = out.scheduled[0]
    assert (sch.num_new_tokens, sch.num_spec_tokens) == (1, 4)
    assert out.num_tokens == 5
    # 6 prompt + 1 output computed next: positions 6..10 -> blocks for 11 tokens = 3
    assert len(s.blocks.block_tables["r"]) == 3
    s.update(["r"], [8, 9], num_tokens=[2], num_proposed=[4])  # one draft accepted
    assert req.output_token_ids == [7, 8, 9]
    assert req.num_computed_tokens == 8  # the prompt, 7 and the accepted 8
    assert len(s.blocks.block_tables["r"]) == 2  # the third block held only rejected drafts
    assert (s.num_spec_rounds, s.num_draft_tokens, s.num_accepted_tokens) == (1, 4, 1)
    s.check_integrity()
    assert s.blocks.num_used_blocks == 2


def test_draft_slots_never_exceed_what_the_request_may_still_produce() -> None:
    s, req = _decoding(k=8, max_tokens=4)  # 1 produced, 3 to go: at most 2 drafts
    assert s.schedule().scheduled[0].num_spec_tokens == 2
    s.update(["r"], [1, 2, 3], num_tokens=[3], num_proposed=[2])
    assert req.is_finished and req.output_token_ids == [7, 1, 2, 3]
    assert s.blocks.num_used_blocks == 0


def test_tokens_after_a_stop_token_are_dropped() -> None:
    s = SchedulingPolicy(BlockManager(32, 4), PolicyConfig(num_speculative_tokens=4))
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=20, temperature=0.0), eos_token_ids=[2])
    s.add(req)
    s.schedule()
    s.update(["r"], [5])
    s.schedule()
    results = s.update(["r"], [6, 2, 9], num_tokens=[3], num_proposed=[4])
    assert results[0][1] == [6, 2] and req.output_token_ids == [5, 6, 2]
    assert req.is_finished and s.blocks.num_used_blocks == 0
    s.check_integrity()


def test_requests_with_drafts_in_flight_are_not_planned_again_nor_preempted() -> None:
    """With overlapped scheduling a second plan is made before the first's result: a
    request whose drafts are in flight is skipped (its next input is unknown)."""
    s, req = _decoding(k=2)
    first = s.schedule()
    assert first.scheduled[0].num_spec_tokens == 2
    assert not s.schedule().scheduled  # in flight: nothing to plan for it
    newer = Request("n", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0))
    s.running.append(newer)
    req.priority, newer.priority = 9, 0  # even as the lowest priority it is not the victim
    assert s._pick_victim(0) is newer
    s.running.remove(newer)
    s.update(["r"], [3, 4, 5], num_tokens=[3], num_proposed=[2])
    assert req.num_computed_tokens == 9 and req.num_spec_in_flight == 0
    assert s.schedule().scheduled[0].num_spec_tokens == 2


def test_requests_with_logits_controls_or_logprobs_get_no_draft_slots() -> None:
    """Drafts are verified without penalties, bias, min_tokens or bad words; min_p, a
    sampling filter that verification applies, keeps its slots."""
    s = SchedulingPolicy(BlockManager(32, 4), PolicyConfig(num_speculative_tokens=3))
    kinds = {
        "penalty": SamplingParams(max_tokens=9, temperature=0.0, presence_penalty=0.5),
        "bias": SamplingParams(
            max_tokens=9, temperature=0.0, logit_bias_token_ids=[1], logit_bias_values=[2.0]
        ),
        "min_tokens": SamplingParams(max_tokens=9, temperature=0.0, min_tokens=3),
        "bad_words": SamplingParams(max_tokens=9, temperature=0.0, bad_words_token_ids=[[4]]),
        "min_p": SamplingParams(max_tokens=9, temperature=0.8, min_p=0.1),
        # logprobs are reported for sampled rows only, not for verified drafts
        "logprobs": SamplingParams(max_tokens=9, temperature=0.0, logprobs=2),
        "prompt_logprobs": SamplingParams(max_tokens=9, temperature=0.0, prompt_logprobs=2),
    }
    for rid, sampling in kinds.items():
        s.add(Request(rid, [100, 101, 102], sampling))
    s.schedule()
    s.update(list(kinds), [7] * len(kinds))
    slots = {x.request.request_id: x.num_spec_tokens for x in s.schedule().scheduled}
    assert slots == {
        "penalty": 0,
        "bias": 0,
        "min_tokens": 0,
        "bad_words": 0,
        "min_p": 3,
        "logprobs": 0,
        "prompt_logprobs": 3,  # (its prompt is done: the output's drafts are fine)
    }
