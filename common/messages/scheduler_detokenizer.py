"""scheduler -> detokenizer: new requests once, then each step's tokens."""

from __future__ import annotations

import dataclasses

from common.codec import message


@message("detok_new")
class DetokNew:
    """Requests the scheduler accepted; sent before any of their tokens."""

    request_ids: list[str]  # [num_reqs]
    stop: list[list[str]]  # [num_reqs][*] stop strings
    num_prompt_tokens: list[int]  # [num_reqs]
    prompt_tails: list[list[int]] = dataclasses.field(default_factory=list)
    # [num_reqs][<=6] last prompt tokens, so the first output word spaces as in the full text


@message("token_batch")
class TokenBatch:
    """New tokens of one step; a finished request has its reason set (0 = still running)."""

    request_ids: list[str]  # [num_reqs]
    token_ids: list[list[int]]  # [num_reqs][*]
    finish_reasons: list[int]  # [num_reqs] FinishReason
    num_cached_tokens: list[int] = dataclasses.field(default_factory=list)  # [num_reqs]
    versions: list[str] = dataclasses.field(default_factory=list)  # [num_reqs] model version
    # that serves each request ("" when unknown); the gateway's system_fingerprint
