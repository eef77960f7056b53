"""scheduler -> detokenizer: new requests once, then each step's tokens."""

from __future__ import annotations

import dataclasses

from common.codec import message


@message("detok_new")
class DetokNew:
    """Sequences the scheduler accepted; sent before any of their tokens. A request with
    `n` > 1 has n sequences: the same request id, indices 0..n-1."""

    request_ids: list[str]  # [num_seqs] the client's request id
    stop: list[list[str]]  # [num_reqs][*] stop strings
    num_prompt_tokens: list[int]  # [num_reqs]
    prompt_tails: list[list[int]] = dataclasses.field(default_factory=list)
    # [num_reqs][<=6] last prompt tokens, so the first output word spaces as in the full text
    seq_indices: list[int] = dataclasses.field(default_factory=list)  # [num_seqs] 0..n-1
    # (empty: every index is 0)
    tokenizers: list[str] = dataclasses.field(default_factory=list)  # [num_seqs] fingerprint
    # of the tokenizer the prompt was tokenised with, which decodes the outputs ("" or empty:
    # the tokenizer of the model the detokenizer started with)
    min_tokens: list[int] = dataclasses.field(default_factory=list)  # [num_seqs] no stop string
    # ends within this many output tokens' text (empty: 0 for every sequence)
    # vLLM's output options (SamplingParams), per sequence; empty: the defaults for every one
    include_stop_str: list[bool] = dataclasses.field(default_factory=list)  # [num_seqs] False
    skip_special_tokens: list[bool] = dataclasses.field(default_factory=list)  # [num_seqs] True
    stop_token_ids: list[list[int]] = dataclasses.field(default_factory=list)  # [num_seqs][*]
    # (what a finish names as its stop_reason when one of them ended the sequence)
    # a resumed sequence's outputs so far, whose text the client already has: decoded
    # silently, so its text continues after them (empty: none for every sequence)
    resumed_token_ids: list[list[int]] = dataclasses.field(default_factory=list)  # [num_seqs][*]


@message("token_batch")
class TokenBatch:
    """New tokens of one step; a finished sequence has its reason set (0 = still running).
    FinishReason.ERROR means "forget it silently": the gateway was told by the scheduler."""

    request_ids: list[str]  # [num_reqs]
    token_ids: list[list[int]]  # [num_reqs][*]
    finish_reasons: list[int]  # [num_reqs] FinishReason
    num_cached_tokens: list[int] = dataclasses.field(default_factory=list)  # [num_reqs]
    versions: list[str] = dataclasses.field(default_factory=list)  # [num_reqs] model version
    # that serves each request ("" when unknown); the gateway's system_fingerprint
    seq_indices: list[int] = dataclasses.field(default_factory=list)  # [num_reqs] 0..n-1
    # (empty: every index is 0)
    # logprobs, for requests that asked (empty when none in the batch did; [] for the others),
    # laid out as in StepResult: per token [sampled, top 1..k] ids and values
    logprob_token_ids: list[list[list[int]]] = dataclasses.field(default_factory=list)
    # [num_reqs][num_tokens][1+k]
    logprob_values: list[list[list[float]]] = dataclasses.field(default_factory=list)
    # [num_reqs][num_tokens][1+k]
    prompt_logprob_token_ids: list[list[list[int]]] = dataclasses.field(default_factory=list)
    # [num_reqs][num_prompt][1+k] (entry 0: [first prompt token], value [])
    prompt_logprob_values: list[list[list[float]]] = dataclasses.field(default_factory=list)
    # [num_reqs][num_prompt] each prompt token's rank (0 for the first)
    prompt_logprob_ranks: list[list[int]] = dataclasses.field(default_factory=list)
    # embeddings: a pooling request's vector, with its finish (no token); [] for the others,
    # and empty when no request of the batch has one
    embeddings: list[list[float]] = dataclasses.field(default_factory=list)  # [num_reqs][H]
