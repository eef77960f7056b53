"""The body of POST /v1/completions and its conversion to engine requests: the fields every
generate body shares, their checks and their limits are services/gateway/openai/protocol.py's;
here what completions add: `prompt` as a batch (at most MAX_PROMPTS strings or token-id lists,
each its own engine request; `prompt_batch` also reads embeddings' `input`), `echo`,
`logprobs` as a count, `best_of`, and the refusal of `suffix`."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from pydantic import (
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from common.limits import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    INT32_MAX,
    MAX_PROMPTS,
)
from common.messages import GenerateRequest
from services.gateway.openai.protocol import (
    NumChoices,
    NumLogprobs,
    _CommonRequest,
    _refuse,
)
from services.gateway.openai.refused import (
    IGNORED_FIELDS,
    REFUSED_COMPLETION,
    check_disjoint,
    refuse_unsupported,
)
from services.gateway.openai.unknown_fields import check_unknown

Prompt = str | list[int]  # text, or token ids


def _prompts(value: Any) -> list[Prompt]:
    """`prompt` as a batch (at most MAX_PROMPTS prompts): see `prompt_batch`."""
    return prompt_batch(value, "prompt", MAX_PROMPTS)


def prompt_batch(value: Any, field: str, limit: int) -> list[Prompt]:
    """A `field` of prompts (completions' `prompt`, embeddings' `input`) as a batch: a string
    or a list of token ids is one prompt; a list of strings or of token-id lists is several
    (at most `limit`). Errors are typed `<field>_type`, `<field>_empty`, ... and name it."""
    if isinstance(value, str) or (
        isinstance(value, list) and value and not isinstance(value[0], str | list | None)
    ):
        return [_prompt(value, "", field)]
    if not isinstance(value, list):
        raise PydanticCustomError(
            f"{field}_type", "must be a string, a list of token ids, or a list of those"
        )
    if not value:
        raise PydanticCustomError(f"{field}_empty", "must not be empty")
    if len(value) > limit:
        raise PydanticCustomError(
            f"{field}_count",
            "at most {limit} {field}s in one request, got {count}",
            {"limit": limit, "count": len(value), "field": field},
        )
    where = f"{field} {{index}} " if len(value) > 1 else ""
    return [_prompt(p, where.format(index=i), field) for i, p in enumerate(value)]


def _prompt(value: Any, where: str, field: str) -> Prompt:
    """One prompt of the batch (`where` names it in a batch of several)."""
    if not isinstance(value, str | list):
        raise PydanticCustomError(
            f"{field}_type", "{where}must be a string or a list of token ids", {"where": where}
        )
    if not value:
        raise PydanticCustomError(f"{field}_empty", "{where}must not be empty", {"where": where})
    if isinstance(value, list):
        for t in value:
            if type(t) is not int or not 0 <= t <= INT32_MAX:
                raise PydanticCustomError(
                    f"{field}_token",
                    "{where}token ids must be integers in [0, {limit}]",
                    {"where": where, "limit": INT32_MAX},
                )
    return value


class CompletionRequest(_CommonRequest):
    """Body of POST /v1/completions."""

    prompt: Any  # list[Prompt] once validated: one engine request each
    echo: bool | None = None
    logprobs: NumLogprobs | None = None
    best_of: NumChoices | None = None  # >= n: the n best of best_of (openai/best_of.py)
    suffix: str | None = None

    _check_prompt = field_validator("prompt", mode="before")(_prompts)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any, info: ValidationInfo) -> Any:
        known = [*REFUSED_COMPLETION, *IGNORED_FIELDS]
        check_unknown(data, cls, known, cls.__name__, info.context)
        return refuse_unsupported(data, REFUSED_COMPLETION, cls.__name__)

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """What the engine computes for the prompt: `prompt_logprobs`, or with echo and
        logprobs at least that many (echo shows the prompt tokens' logprobs)."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    @field_validator("best_of")
    @classmethod
    def _best_of_at_least_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        # `n` is declared (so validated) first; when it failed, that error is the one reported
        if value is None or "n" not in info.data:
            return value
        n = info.data["n"] or 1
        if value < n:
            raise _refuse(f"must be >= n ({n}), got {value}")
        if value > n and info.data.get("stream"):
            raise _refuse("best_of > n cannot be streamed (the best are known at the end)")
        return value

    @property
    def beam_width(self) -> int:
        return max(self.n or 1, self.best_of or 1)

    @property
    def ranks_best_of(self) -> bool:
        """The engine samples best_of sequences per prompt and the answer keeps n."""
        best_of, n = self.best_of, self.n or 1
        return best_of is not None and best_of > n and not self.use_beam_search

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise _refuse("suffix is not supported")
        return value

    def to_generate_requests(
        self, request_id: str, model: str, max_model_len: int
    ) -> list[GenerateRequest]:
        """One engine request per prompt: `request_id` for a single prompt, else
        `<request_id>-<k>` for prompt k."""
        sampling = self._sampling(
            self.max_tokens,
            "max_tokens",
            COMPLETIONS_DEFAULT_MAX_TOKENS,
            max_model_len,
            (self.logprobs or 0) if self.ranks_best_of else self.logprobs,  # (to rank by)
            self.engine_prompt_logprobs,
        )
        if self.ranks_best_of:
            sampling = dataclasses.replace(sampling, n=self.best_of or 1)
        prompts: list[Prompt] = self.prompt
        arrival = time.time()
        return [
            GenerateRequest(
                request_id=request_id if len(prompts) == 1 else f"{request_id}-{k}",
                model=model,
                sampling=sampling,
                prompt=prompt if isinstance(prompt, str) else None,
                prompt_token_ids=None if isinstance(prompt, str) else list(prompt),
                arrival_time=arrival,
                **self._scheduling(max_model_len),
            )
            for k, prompt in enumerate(prompts)
        ]

    def to_generate_request(
        self, request_id: str, model: str, max_model_len: int
    ) -> GenerateRequest:
        """The engine request of a body with one prompt (ValueError for a batch)."""
        (request,) = self.to_generate_requests(request_id, model, max_model_len)
        return request


# a field is honoured (declared above) or refused (services/gateway/openai/refused.py), not both
check_disjoint(CompletionRequest.model_fields, REFUSED_COMPLETION, "CompletionRequest")
