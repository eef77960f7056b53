"""detokenizer -> gateway: text deltas, ready to stream."""

from __future__ import annotations

import dataclasses

from common.codec import message


@message("output_batch")
class OutputBatch:
    request_ids: list[str]  # [num_reqs]
    texts: list[str]  # [num_reqs] new text since the last batch
    token_ids: list[list[int]]  # [num_reqs][*] new token ids
    finish_reasons: list[int]  # [num_reqs] FinishReason, 0 while running
    num_prompt_tokens: list[int]  # [num_reqs]
    num_output_tokens: list[int]  # [num_reqs] so far
    versions: list[str] = dataclasses.field(default_factory=list)  # [num_reqs] model version
    # that serves each request ("" when unknown); the gateway's system_fingerprint
    seq_indices: list[int] = dataclasses.field(default_factory=list)  # [num_reqs] which of
    # the request's n sequences (empty: every index is 0)
    # vLLM's stop_reason of a finished sequence: the stop string or stop token id that ended
    # it, None otherwise (EOS, length, still running); empty: None for every one
    stop_reasons: list[str | int | None] = dataclasses.field(default_factory=list)  # [num_reqs]
    # logprobs as in TokenBatch, with each id's text (the token decoded alone) beside it
    logprob_token_ids: list[list[list[int]]] = dataclasses.field(default_factory=list)
    # [num_reqs][num_tokens][1+k]
    logprob_values: list[list[list[float]]] = dataclasses.field(default_factory=list)
    logprob_tokens: list[list[list[str]]] = dataclasses.field(default_factory=list)
    prompt_logprob_token_ids: list[list[list[int]]] = dataclasses.field(default_factory=list)
    # [num_reqs][num_prompt][1+k] (entry 0: the first prompt token, value [])
    prompt_logprob_values: list[list[list[float]]] = dataclasses.field(default_factory=list)
    prompt_logprob_tokens: list[list[list[str]]] = dataclasses.field(default_factory=list)
    # [num_reqs][num_prompt] each prompt token's rank (0 for the first; [] when not known)
    prompt_logprob_ranks: list[list[int]] = dataclasses.field(default_factory=list)
    # embeddings, as in TokenBatch: a pooling request's vector with its finish
    embeddings: list[list[float]] = dataclasses.field(default_factory=list)  # [num_reqs][H]
    # prompt tokens the prefix cache served at each sequence's prefill (empty: 0 for every one)
    num_cached_tokens: list[int] = dataclasses.field(default_factory=list)  # [num_reqs]
