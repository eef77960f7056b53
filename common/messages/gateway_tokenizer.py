"""gateway -> tokenizer: a request to tokenise and validate; anyone -> gateway: its rejection.
Also gateway -> tokenizer -> gateway: /tokenize and /detokenize, which generate nothing."""

from __future__ import annotations

import dataclasses
from typing import Any

from common.codec import message
from common.messages.types import SamplingParams


@message("generate")
class GenerateRequest:
    """One client request, as the gateway parsed it. Exactly one of the prompt fields is set."""

    request_id: str
    model: str
    sampling: SamplingParams
    prompt: str | None = None  # /v1/completions text
    messages: list[dict[str, Any]] | None = None  # /v1/chat/completions, rendered by template
    prompt_token_ids: list[int] | None = None  # pre-tokenised prompt
    add_generation_prompt: bool = True
    arrival_time: float = 0.0  # time.time() at the gateway
    priority: int = 0  # with --scheduling-policy priority: lower runs first
    timeout: float | None = None  # seconds from arrival; then finish reason `timeout`
    # sampling fields the client left unset (`sampling` holds our defaults there): with
    # --generation-config auto the tokenizer fills them from the model's generation_config
    unset_sampling: list[str] = dataclasses.field(default_factory=list)
    # chat only: the request's own template (None: --chat-template, else the model's) and
    # the extra variables it renders with (e.g. {"enable_thinking": false})
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # chat only: the functions the prompt offers ({"name", "description", "parameters"} each;
    # None: no tools), rendered by services/tokenizer/tool_prompt.py
    tools: list[dict[str, Any]] | None = None
    # how the prompt is tokenised (vLLM's extensions): with the tokenizer's special tokens
    # (None: the endpoint's default, yes for a completions prompt, no for a rendered chat,
    # whose template writes its own)
    add_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens
    continue_final_message: bool = False  # chat: the last message is continued, not closed
    cache_salt: str = ""  # vLLM's: only requests with the same salt share prefix-cache blocks
    lora_name: str = ""  # the LoRA adapter `model` names ("": the base model)
    # embeddings (sampling.pooling): the vector's size the client asked for, which the model
    # must allow (Matryoshka: its config.json's is_matryoshka / matryoshka_dimensions)
    dimensions: int | None = None
    # a resumed request (a process behind the gateway died mid-stream): the output token ids
    # the client already has; generation continues after them, as after a preemption by
    # recompute, and the response counts them (max_tokens, usage) as this request's outputs
    resumed_token_ids: list[int] = dataclasses.field(default_factory=list)  # [num_resumed]


@message("request_error")
class RequestError:
    """A request refused before or during scheduling; the gateway answers it with `status`."""

    request_id: str
    status: int  # HTTP status: 400 bad input, 404 unknown model, 429 overload, 503 down
    message: str
    param: str | None = None  # the offending field, when there is one
    # the request was lost to a process's death (or its restart), not refused: the gateway
    # may send it again, with the tokens it has streamed, once the engine serves again
    resumable: bool = False


@message("retokenize")
class Retokenize:
    """scheduler -> gateway: the request was tokenised by a tokenizer that no longer serves
    (a hot-swap changed it before the request started); send it to a tokenizer again."""

    request_id: str


@message("tokenize_query")
class TokenizeQuery:
    """gateway -> a tokenizer: the token ids of a prompt (POST /tokenize), as the served
    model's tokenizer makes them; exactly one of `prompt`, `messages` is set. The answer is a
    TokenizeResult to `reply_to`."""

    query_id: int
    reply_to: str  # the gateway's inbox
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None  # rendered by the chat template
    add_special_tokens: bool = True
    add_generation_prompt: bool = True  # messages only
    chat_template: str | None = None  # messages only: as GenerateRequest's
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None  # messages only: as GenerateRequest's


@message("detokenize_query")
class DetokenizeQuery:
    """gateway -> a tokenizer: the text of token ids (POST /detokenize); the answer is a
    TokenizeResult to `reply_to`."""

    query_id: int
    reply_to: str
    token_ids: list[int]


@message("tokenize_result")
class TokenizeResult:
    """tokenizer -> gateway: the answer to a TokenizeQuery (`token_ids`) or a
    DetokenizeQuery (`text`), or its refusal (`status` other than 200)."""

    query_id: int
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    status: int = 200  # HTTP status: 400 bad input (message names `param`)
    message: str = ""
    param: str | None = None
