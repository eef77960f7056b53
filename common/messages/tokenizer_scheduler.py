"""tokenizer -> scheduler: a validated, tokenised request."""

from __future__ import annotations

import dataclasses

from common.codec import message
from common.messages.types import SamplingParams


@message("tokenized")
class TokenizedRequest:
    request_id: str
    prompt_token_ids: list[int]  # [num_prompt_tokens]
    sampling: SamplingParams
    eos_token_ids: list[int] = dataclasses.field(default_factory=list)
    arrival_time: float = 0.0
    priority: int = 0  # with --scheduling-policy priority: lower runs first
    timeout: float | None = None  # seconds from arrival; then finish reason `timeout`
    tokenizer_fingerprint: str = ""  # the tokenizer that made prompt_token_ids: the request
    # may only start on a model version with this tokenizer ("": the start-up model's)
    cache_salt: str = ""  # vLLM's: salts the request's prefix-cache root ("": none)
    lora_name: str = ""  # the LoRA adapter the request runs with ("": the base model)
    # a resumed request (GenerateRequest.resumed_token_ids): outputs it already produced,
    # which the scheduler recomputes after the prompt before it samples the next token
    resumed_token_ids: list[int] = dataclasses.field(default_factory=list)  # [num_resumed]
