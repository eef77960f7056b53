"""step_batch (gpu_worker/runner/step_batch.py): how a step's requests are packed (decodes first,
drafts after their request's last token, prompt-logprob rows last) and what the sampling rows
give back, on request states the real RequestTable checked."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.messages import SamplingParams, StepPlan
from gpu_worker.attention import AttentionBackend, create_backend
from gpu_worker.runner.request_table import RequestState, RequestTable
from gpu_worker.runner.step_batch import Drafts, accept, prepare_batch, propose
from gpu_worker.sample.logits_controls import TokenCounts

BLOCK_SIZE = 4
VOCAB = 32
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def backend() -> AttentionBackend:
    return create_backend(
        "torch", num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, device=CPU
    )


def _scheduled(
    reqs: dict[str, tuple[list[int], int, int, list[int], SamplingParams]],
    spec: list[int] | None = None,
) -> tuple[StepPlan, list[RequestState]]:
    """New requests (prompt, num_computed, num_new, blocks, params) scheduled in one plan."""
    plan = StepPlan(
        0,
        new_req_ids=list(reqs),
        new_prompt_token_ids=[r[0] for r in reqs.values()],
        new_sampling=[r[4] for r in reqs.values()],
        req_ids=list(reqs),
        num_computed_tokens=[r[1] for r in reqs.values()],
        num_new_tokens=[r[2] for r in reqs.values()],
        new_block_ids=[r[3] for r in reqs.values()],
        num_spec_tokens=spec or [],
    )
    table = RequestTable(block_size=BLOCK_SIZE, num_blocks=16, max_model_len=64)
    table.apply_diffs(plan, "v", {"v"})
    return plan, table.schedule(plan)


def _propose(plan: StepPlan, states: list[RequestState], method: str = "ngram") -> Drafts:
    indices = list(range(len(states)))
    return propose(plan, indices, states, method=method, drafter=None, prompt_lookup=(1, 2))


def test_decodes_go_first_and_sampling_rows_keep_the_plan_order(
    backend: AttentionBackend,
) -> None:
    asks = dataclasses.replace(GREEDY, prompt_logprobs=1)
    plan, states = _scheduled(
        {
            "p": ([10, 11, 12, 13, 14], 0, 5, [0, 1], asks),  # whole prompt: samples
            "c": ([20, 21, 22, 23, 24, 25], 0, 4, [2], GREEDY),  # first chunk: does not
            "d": ([1, 2, 3], 2, 1, [3], GREEDY),  # two tokens cached: a decode of one
        }
    )
    drafts = _propose(plan, states)
    batch = prepare_batch(
        plan, [0, 1, 2], states, drafts, block_size=BLOCK_SIZE, backend=backend, device=CPU
    )
    # packed: d | p p p p p | c c c c
    assert batch.input_ids.tolist() == [3, 10, 11, 12, 13, 14, 20, 21, 22, 23]
    assert batch.meta.num_decodes == 1 and batch.meta.query_start_loc_host == [0, 1, 6, 10]
    assert batch.meta.positions.tolist() == [2, 0, 1, 2, 3, 4, 0, 1, 2, 3]
    assert batch.sampling_req_ids == ["p", "d"]  # the plan's order, not the packing's
    assert batch.num_sampling_rows == 2
    # p's last token (row 5), d's (row 0); then p's prompt positions 0..3 (rows 1..4)
    assert batch.logits_indices.tolist() == [5, 0, 1, 2, 3, 4]
    assert [(s.req_id, r) for s, r in batch.prompt_rows] == [("p", range(0, 4))]
    assert batch.drafts == [[], []] and batch.spec_slots == [0, 0]


def test_drafts_follow_their_request_last_token_and_take_logits_rows(
    backend: AttentionBackend,
) -> None:
    plan, states = _scheduled(
        {
            "s": ([1, 2, 1, 2, 1], 4, 1, [0, 1], GREEDY),  # 2 draft slots: "2 1" repeats
            "d": ([7, 8], 1, 1, [2], GREEDY),
        },
        spec=[2, 0],
    )
    assert _propose(plan, states, method="").tokens == {0: [], 1: []}  # speculation off
    drafts = _propose(plan, states)
    assert drafts.tokens == {0: [2, 1], 1: []} and drafts.probs == {0: None, 1: None}
    batch = prepare_batch(
        plan, [0, 1], states, drafts, block_size=BLOCK_SIZE, backend=backend, device=CPU
    )
    assert batch.input_ids.tolist() == [8, 1, 2, 1]  # d's decode, then s: last token + drafts
    assert batch.meta.num_decodes == 1  # s computes 3 tokens: not a decode any more
    assert batch.logits_indices.tolist() == [1, 2, 3, 0]  # s's 1 + 2 rows, then d's
    assert batch.drafts == [[2, 1], []] and batch.spec_slots == [2, 0]
    assert batch.num_sampling_rows == 4


def test_accept_samples_each_row_and_verifies_drafts(backend: AttentionBackend) -> None:
    plan, states = _scheduled(
        {"s": ([1, 2, 1, 2, 1], 4, 1, [0, 1], GREEDY), "d": ([7, 8], 1, 1, [2], GREEDY)},
        spec=[2, 0],
    )
    batch = prepare_batch(
        plan, [0, 1], states, _propose(plan, states), block_size=BLOCK_SIZE, backend=backend,
        device=CPU,
    )  # fmt: skip
    # greedy rows: s's target agrees with its first draft (2), not its second (9 for 1)
    logits = torch.full((batch.num_sampling_rows, VOCAB), -10.0)
    for row, token in enumerate([2, 9, 4, 5]):
        logits[row, token] = 10.0
    tokens = accept(logits, batch, TokenCounts(VOCAB, CPU), BLOCK_SIZE)
    assert tokens == [[2, 9], [5]]  # one draft accepted plus the target's token; d: one
    s, d = states
    assert s.token_ids == [1, 2, 1, 2, 1, 2, 9] and s.num_computed == 6
    assert s.block_table == [0, 1]  # the rejected draft's slot stays inside its blocks
    assert d.token_ids == [7, 8, 5]
