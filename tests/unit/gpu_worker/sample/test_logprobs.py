"""Logprobs on the worker (gpu_worker/sample/logprobs.py) against torch.log_softmax, and the prompt
entries' bookkeeping across chunks, preemptions and forks."""

from __future__ import annotations

import torch

from common.messages.types import SamplingParams
from gpu_worker.runner.request_table import RequestState
from gpu_worker.sample.logprobs import (
    MIN_LOGPROB,
    chosen_ranks,
    prompt_positions,
    take_prompt_logprobs,
    token_logprobs,
)


def test_token_logprobs_match_log_softmax_with_the_chosen_token_first() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=gen) * 3
    reference = torch.log_softmax(logits, dim=-1)
    worst = int(reference[1].argmin())  # far outside any top k
    chosen = [int(reference[0].argmax()), worst, 7, 3]
    num_top = [3, 5, 0, 20]
    ids, values = token_logprobs(logits, chosen, num_top)
    for r in range(4):
        assert len(ids[r]) == len(values[r]) == 1 + num_top[r]
        assert ids[r][0] == chosen[r]  # the chosen token, always, with its own logprob
        assert abs(values[r][0] - float(reference[r, chosen[r]])) < 1e-5
        top = reference[r].topk(num_top[r])
        assert ids[r][1:] == top.indices.tolist()
        assert values[r][1:] == sorted(values[r][1:], reverse=True)
        for token, value in zip(ids[r], values[r], strict=True):
            assert abs(value - float(reference[r, token])) < 1e-5
    assert worst not in ids[1][1:]


def test_no_rows_and_the_floor_for_impossible_tokens() -> None:
    assert token_logprobs(torch.zeros(0, 8), [], []) == ([], [])
    logits = torch.tensor([[0.0, float("-inf"), 1.0]])
    ids, values = token_logprobs(logits, [1], [2])
    assert ids == [[1, 2, 0]] and values[0][0] == MIN_LOGPROB


def _state(prompt: list[int], prompt_logprobs: int | None = 2) -> RequestState:
    state = RequestState("r", list(prompt), SamplingParams(prompt_logprobs=prompt_logprobs), 5, "")
    if prompt_logprobs is not None:  # as RequestTable adds it
        state.prompt_logprob_ids.append([prompt[0]])
        state.prompt_logprob_values.append([])
        state.prompt_logprob_ranks.append(0)
    return state


def _fill(state: RequestState, positions: range) -> None:
    for p in positions:
        state.prompt_logprob_ids.append([state.token_ids[p + 1]])
        state.prompt_logprob_values.append([-1.0])
        state.prompt_logprob_ranks.append(1)


def test_prompt_entries_over_chunks_and_a_recompute_are_sent_once() -> None:
    state = _state([10, 11, 12, 13, 14])
    assert prompt_positions(state, 0, 3) == range(0, 3)  # predict tokens 1..3
    _fill(state, range(0, 3))
    # preempted and recomputed from 0: the done positions are skipped
    assert not prompt_positions(state, 0, 2)
    assert prompt_positions(state, 2, 3) == range(3, 4)  # the last prompt token samples
    _fill(state, range(3, 4))
    ids, values, ranks = take_prompt_logprobs(state)
    assert ids == [[10], [11], [12], [13], [14]] and values[0] == [] and len(values) == 5
    assert ranks == [0, 1, 1, 1, 1]
    assert take_prompt_logprobs(state) == ([], [], [])  # once
    assert not prompt_positions(state, 0, 5)


def test_no_prompt_entries_for_requests_that_do_not_ask_or_start_past_the_prompt() -> None:
    assert not prompt_positions(_state([1, 2, 3, 4, 5], None), 0, 5)
    assert take_prompt_logprobs(_state([1, 2, 3, 4, 5], None)) == ([], [], [])
    fork = _state([1, 2, 3, 4, 5])  # a fork starts with the shared prompt computed
    assert not prompt_positions(fork, 4, 1)
    assert take_prompt_logprobs(fork) == ([], [], [])  # incomplete: never sent


def test_a_prompt_tokens_rank_counts_the_more_likely_tokens_even_outside_the_top_k() -> None:
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.5, 2.5], [0.0, 0.0, 5.0, -1.0, 1.0]])
    assert chosen_ranks(logits, [3, 2]) == [5, 1]  # row 0: 3.0, 2.5, 2.0, 1.0 above 0.5
    assert chosen_ranks(logits, []) == []
