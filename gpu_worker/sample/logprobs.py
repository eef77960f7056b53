"""Logprobs on the worker: the raw distribution's log-probabilities of chosen tokens and of
each row's top k, for the rows that ask and no others.

"Raw" as in vLLM's default (`logprobs_mode=raw_logprobs`): log_softmax of the model's
logits before logits controls, temperature or filtering. One `log_softmax` and one `topk`
(k = the largest any asking row wants) over the asking rows, one gather for the chosen
tokens, and one copy to the host; each row then keeps its own k.

    row r:  ids    [chosen, top1, top2, ..., topk_r]    (chosen may also be among the top)
            values [lp(chosen), lp(top1), ...]          top values sorted, best first

Output entries: the sampled token's row (requests that ask get no draft slots). Prompt
entries (`prompt_logprobs`): the runner adds the logits rows of an asking request's prompt
positions to its step (position p gives the entry of prompt token p + 1), collects them on
the request across prefill chunks (a recompute after preemption skips those it has), and
sends them all with its first sampled token. Such a request takes no prefix-cache hits
(the scheduler's policy), so every position is computed.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from gpu_worker.runner.request_table import RequestState

# OpenAI's floor for a logprob: -inf would not survive JSON
MIN_LOGPROB = -9999.0


def token_logprobs(
    logits: torch.Tensor,  # [R, vocab] the asking rows' raw logits
    chosen: list[int],  # [R] the token each row reports first (sampled, or the prompt's next)
    num_top: list[int],  # [R] top-k count per row, >= 0
) -> tuple[list[list[int]], list[list[float]]]:
    """Each row's [chosen, top 1..k] ids and their logprobs (see the module's docstring)."""
    assert logits.dim() == 2 and logits.shape[0] == len(chosen) == len(num_top)
    if not chosen:
        return [], []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(chosen, dtype=torch.int64, device=logits.device)[:, None]
    chosen_lp = logprobs.gather(1, index)  # [R, 1]
    k = max(num_top)
    if k:
        top_lp, top_ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)  # sorted
        values = torch.cat([chosen_lp, top_lp], dim=1)
        ids = torch.cat([index, top_ids], dim=1)
    else:
        values, ids = chosen_lp, index
    values = values.clamp(min=MIN_LOGPROB)
    ids_rows, value_rows = ids.tolist(), values.tolist()
    return (
        [row[: 1 + n] for row, n in zip(ids_rows, num_top, strict=True)],
        [row[: 1 + n] for row, n in zip(value_rows, num_top, strict=True)],
    )


def prompt_positions(state: RequestState, num_computed: int, num_new: int) -> range:
    """The positions of a chunk [num_computed, num_computed + num_new) whose logits give a
    prompt entry the request still lacks: position p predicts prompt token p + 1. Empty
    when the request does not ask, or when KV it did not compute (a fork's shared prompt)
    left a gap: its prompt logprobs stay incomplete and are never sent."""
    if state.params.prompt_logprobs is None or state.prompt_logprobs_sent:
        return range(0)
    start = len(state.prompt_logprob_ids) - 1  # (a recompute after preemption skips these)
    if num_computed > start:
        return range(0)
    return range(start, min(num_computed + num_new, state.num_prompt - 1))


def chosen_ranks(logits: torch.Tensor, chosen: list[int]) -> list[int]:
    """Each row's rank of its chosen token: 1 + the number of tokens more likely (vLLM's
    rank, also for a token outside the top k)."""
    if not chosen:
        return []
    index = torch.tensor(chosen, dtype=torch.int64, device=logits.device)[:, None]
    return ((logits > logits.gather(1, index)).sum(dim=-1) + 1).tolist()


def take_prompt_logprobs(
    state: RequestState,
) -> tuple[list[list[int]], list[list[float]], list[int]]:
    """The request's prompt entries and their tokens' ranks when it samples its first token:
    all of them once, then (and for requests that did not ask, or whose entries are
    incomplete) nothing."""
    if state.params.prompt_logprobs is None or state.prompt_logprobs_sent:
        return [], [], []
    state.prompt_logprobs_sent = True
    if len(state.prompt_logprob_ids) != state.num_prompt:
        return [], [], []
    ids, values, ranks = (
        state.prompt_logprob_ids,
        state.prompt_logprob_values,
        state.prompt_logprob_ranks,
    )
    state.prompt_logprob_ids, state.prompt_logprob_values, state.prompt_logprob_ranks = [], [], []
    return ids, values, ranks


Entries = tuple[list[list[int]], list[list[float]]]  # ([ids], [values]) per token
# a request's prompt entries and the rank of each prompt token (0 for the first: none)
PromptEntries = tuple[list[list[int]], list[list[float]], list[int]]


def output_entries(
    logits: torch.Tensor,  # the step's logits rows: each sampling request's, drafts after
    req_ids: list[str],  # [S] the sampling requests
    states: list[RequestState],  # [S]
    drafts: list[list[int]],  # [S] each one's draft tokens (a row each after its own)
    accepted: list[list[int]],  # [S] the tokens each produced
) -> dict[str, Entries]:
    """The sampled tokens' entries of the requests that ask, from one batched pass over
    their rows (they have no drafts: the scheduler gives them no draft slots)."""
    asking = [j for j, s in enumerate(states) if s.params.logprobs is not None]
    if not asking:
        return {}
    first = list(itertools.accumulate((1 + len(d) for d in drafts), initial=0))
    ids, values = token_logprobs(
        logits[[first[j] for j in asking]],
        [accepted[j][0] for j in asking],
        [states[j].params.logprobs or 0 for j in asking],
    )
    return {req_ids[j]: ([ids[m]], [values[m]]) for m, j in enumerate(asking)}


def add_prompt_entries(logits: torch.Tensor, rows: list[tuple[RequestState, range]]) -> None:
    """Append to each request the prompt entries its logits rows give (`rows`: requests
    and the prompt positions of the logits rows, in order)."""
    if not rows:
        return
    chosen = [s.token_ids[p + 1] for s, positions in rows for p in positions]
    num_top = [s.params.prompt_logprobs or 0 for s, positions in rows for _ in positions]
    ids, values = token_logprobs(logits, chosen, num_top)
    ranks = chosen_ranks(logits, chosen)
    k = 0
    for state, positions in rows:
        state.prompt_logprob_ids.extend(ids[k : k + len(positions)])
        state.prompt_logprob_values.extend(values[k : k + len(positions)])
        state.prompt_logprob_ranks.extend(ranks[k : k + len(positions)])
        k += len(positions)


def step_result_fields(
    order: list[str],
    sampled: dict[str, list[int]],
    logprobs: dict[str, Entries],
    prompt: dict[str, PromptEntries],
) -> dict[str, Any]:
    """StepResult's logprob lists for the sampled requests `order` (none when no request
    of the step asked): `logprobs` and `prompt` hold the entries of those that asked."""
    out: dict[str, Any] = {}
    if logprobs:
        token_ids: list[list[int]] = []
        values: list[list[float]] = []
        for rid in order:
            ids_i, values_i = logprobs.get(rid, ([], []))
            token_ids += ids_i or [[] for _ in sampled[rid]]
            values += values_i or [[] for _ in sampled[rid]]
        out["logprob_token_ids"], out["logprob_values"] = token_ids, values
    if any(ids for ids, _, _ in prompt.values()):
        entries = [prompt.get(rid, ([], [], [])) for rid in order]
        out["prompt_logprob_token_ids"] = [ids for ids, _, _ in entries]
        out["prompt_logprob_values"] = [values for _, values, _ in entries]
        out["prompt_logprob_ranks"] = [ranks for _, _, ranks in entries]
    return out
