"""What EngineCore tells the detokenizer: a request's sequences when it is admitted
(DetokNew), their tokens after each step and how they end (TokenBatch). Built from the
policy's results; messages carry the request id and the sequence index side by side."""

from __future__ import annotations

import itertools
from typing import Any

from common.messages import (
    DetokNew,
    FinishReason,
    SamplingParams,
    StepResult,
    TokenBatch,
    TokenizedRequest,
)
from services.scheduler.request import Request

PROMPT_TAIL = 6  # prompt tokens the detokenizer needs to space the first output word

# a live sequence's tokens from one step: (the sequence, the tokens it kept, how it ends)
Result = tuple[Request, list[int], FinishReason]


def new_sequences(msg: TokenizedRequest, n: int) -> DetokNew:
    """The `n` sequences of an admitted request."""
    return DetokNew(
        request_ids=[msg.request_id] * n,
        stop=[list(msg.sampling.stop)] * n,
        num_prompt_tokens=[len(msg.prompt_token_ids)] * n,
        prompt_tails=[msg.prompt_token_ids[-PROMPT_TAIL:]] * n,
        seq_indices=list(range(n)),
        tokenizers=[msg.tokenizer_fingerprint] * n,
        min_tokens=[msg.sampling.min_tokens] * n if msg.sampling.min_tokens else [],
        resumed_token_ids=[list(msg.resumed_token_ids)] * n if msg.resumed_token_ids else [],
        **_output_options(msg.sampling, n),
    )


def ended(reqs: list[Request]) -> TokenBatch:
    """These sequences ended without a new token (abort, timeout, error)."""
    return TokenBatch(
        request_ids=[r.group_id for r in reqs],
        token_ids=[[] for _ in reqs],
        finish_reasons=[int(r.finish_reason) for r in reqs],
        seq_indices=[r.seq_index for r in reqs],
    )


def step_tokens(msg: StepResult, results: list[Result], num_pooled: int) -> TokenBatch:
    """A step's tokens for its live sequences (`results`, the last `num_pooled` of them
    pooled: embeddings), with the logprobs and vectors `msg` carries for them."""
    return TokenBatch(
        request_ids=[r.group_id for r, _, _ in results],
        token_ids=[tokens for _, tokens, _ in results],
        finish_reasons=[int(f) for _, _, f in results],
        num_cached_tokens=[r.num_cached_tokens for r, _, _ in results],
        versions=[r.version or "" for r, _, _ in results],
        seq_indices=[r.seq_index for r, _, _ in results],
        **_logprob_fields(msg, results),
        **_embedding_fields(msg, results, num_pooled),
    )


def _logprob_fields(msg: StepResult, results: list[Result]) -> dict[str, Any]:
    """TokenBatch's logprob lists for `results` (the live requests of `msg`, each with the
    tokens it kept: a stop may cut a request's tokens short), or none when nobody asked."""
    out: dict[str, Any] = {}
    if not (msg.logprob_token_ids or msg.prompt_logprob_token_ids):
        return out
    counts = msg.num_tokens or [1] * len(msg.req_ids)
    starts = dict(zip(msg.req_ids, itertools.accumulate(counts, initial=0), strict=False))
    rows = {rid: i for i, rid in enumerate(msg.req_ids)}
    # (a pooled request, an embeddings one, sampled nothing: its entries are empty)
    if msg.logprob_token_ids:
        spans = [(starts.get(r.request_id, 0), len(kept)) for r, kept, _ in results]
        out["logprob_token_ids"] = [msg.logprob_token_ids[a : a + n] for a, n in spans]
        out["logprob_values"] = [msg.logprob_values[a : a + n] for a, n in spans]
    if msg.prompt_logprob_token_ids:
        index = [rows.get(r.request_id) for r, _, _ in results]

        def pick(entries: list[Any]) -> list[Any]:
            return [entries[i] if i is not None else [] for i in index]

        out["prompt_logprob_token_ids"] = pick(msg.prompt_logprob_token_ids)
        out["prompt_logprob_values"] = pick(msg.prompt_logprob_values)
        if msg.prompt_logprob_ranks:
            out["prompt_logprob_ranks"] = pick(msg.prompt_logprob_ranks)
    return out


def _embedding_fields(msg: StepResult, results: list[Result], num_pooled: int) -> dict[str, Any]:
    """TokenBatch's embeddings: the vectors of the last `num_pooled` results (the live
    pooled requests of `msg`), [] for the others; none when no request pooled."""
    if not num_pooled:
        return {}
    vectors = dict(zip(msg.pooled_req_ids, msg.embeddings, strict=True))
    head: list[list[float]] = [[] for _ in results[: len(results) - num_pooled]]
    return {"embeddings": head + [vectors[r.request_id] for r, _, _ in results[-num_pooled:]]}


def _output_options(sampling: SamplingParams, n: int) -> dict[str, Any]:
    """DetokNew's per-sequence output options for a request of `n` sequences: empty lists
    where every sequence takes the default (most requests: nothing more on the wire)."""
    out: dict[str, Any] = {}
    if sampling.include_stop_str_in_output:
        out["include_stop_str"] = [True] * n
    if not sampling.skip_special_tokens:
        out["skip_special_tokens"] = [False] * n
    if sampling.stop_token_ids:
        out["stop_token_ids"] = [list(sampling.stop_token_ids)] * n
    return out
