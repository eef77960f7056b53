"""vLLM's tokenizer routes, answered by a tokenizer process (the gateway never tokenises):

    POST /tokenize    {model?, prompt | messages, add_special_tokens?, add_generation_prompt?,
                       chat_template?, chat_template_kwargs?, tools?}
                      -> {count, max_model_len, tokens, token_strs: null}
    POST /detokenize  {model?, tokens} -> {prompt}

As in vLLM, `add_special_tokens` defaults to true for a prompt and to false for messages
(the chat template writes the special tokens it wants); `add_generation_prompt` (messages
only) to true; `chat_template` (with --trust-request-chat-template) and
`chat_template_kwargs` render messages as they would a chat request, and so do `tools` (as a
chat request with tool_choice auto renders them). The ids are those the
served model's tokenizer makes for a generate request with the same prompt. Both routes want
the API key when one is set.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Annotated, Any, TypeVar

import orjson
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError
from starlette.responses import Response

from services.gateway.engine.client import EngineClient
from services.gateway.http.openapi import json_body
from services.gateway.openai.chat_messages import ChatMessage
from services.gateway.openai.chat_protocol import (
    ChatTemplate,
    bounded_template_kwargs,
    trusted_chat_template,
)
from services.gateway.openai.protocol import TokenId, lora_of
from services.gateway.openai.request_errors import RequestRejected, parse_request
from services.gateway.openai.structured import StructuredError
from services.gateway.openai.tools import check_tools
from services.gateway.openai.unknown_fields import check_unknown

TOKENIZER_TIMEOUT_S = 10.0
MAX_DETOKENIZE_IDS = 1 << 20
_STRICT = ConfigDict(strict=True, extra="ignore")  # as the generate bodies are parsed
T = TypeVar("T")


class TokenizeRequest(BaseModel):
    """Body of POST /tokenize: a prompt, or chat messages."""

    model_config = _STRICT
    model: str | None = None
    prompt: Annotated[str, Field(min_length=1)] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    return_token_strs: bool | None = None
    chat_template: ChatTemplate | None = None  # messages only
    chat_template_kwargs: dict[str, Any] | None = None  # messages only
    tools: Any = None  # messages only: as a chat request's

    @model_validator(mode="before")
    @classmethod
    def _no_unknown_fields(cls, data: Any, info: ValidationInfo) -> Any:
        check_unknown(data, cls, (), cls.__name__, info.context)
        return data

    _trusted_template = field_validator("chat_template")(trusted_chat_template)
    _bounded_kwargs = field_validator("chat_template_kwargs")(bounded_template_kwargs)

    @field_validator("return_token_strs")
    @classmethod
    def _no_token_strs(cls, value: bool | None) -> bool | None:
        if value:
            raise PydanticCustomError("unsupported", "token strings are not supported")
        return value

    def functions(self) -> list[dict[str, Any]] | None:
        """The tools' function objects, checked as a chat request's (None: no tools)."""
        if not self.tools:
            return None
        try:
            return list(check_tools(self.tools).values())
        except StructuredError as e:
            raise RequestRejected(str(e), e.field) from None

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise RequestRejected("prompt: send exactly one of `prompt` or `messages`", "prompt")
        for name in ("chat_template", "chat_template_kwargs", "tools"):
            if self.prompt is not None and getattr(self, name) is not None:
                raise RequestRejected(f"{name}: only with `messages`", name)


class DetokenizeRequest(BaseModel):
    """Body of POST /detokenize."""

    model_config = _STRICT
    model: str | None = None
    tokens: Annotated[list[TokenId], Field(max_length=MAX_DETOKENIZE_IDS)]

    @model_validator(mode="before")
    @classmethod
    def _no_unknown_fields(cls, data: Any, info: ValidationInfo) -> Any:
        check_unknown(data, cls, (), cls.__name__, info.context)
        return data


def _check_model(engine: EngineClient, model: str | None) -> None:
    """check_model, where an adapter's name is good too (it tokenises as its base model)."""
    lora_of(model, engine.model_names, engine.lora_adapters, engine.is_ready(), engine.draining)


def tokenize_router(engine: EngineClient, context: dict[str, Any] | None = None) -> APIRouter:
    """POST /tokenize and /detokenize over `engine` (the caller adds the API key check);
    `context` as parse_request takes it (`trust_request_chat_template`)."""
    router = APIRouter()

    async def tokenize(request: Request) -> Response:
        body = parse_request(TokenizeRequest, await request.body(), context)
        body.check()
        _check_model(engine, body.model)
        is_chat = body.messages is not None
        ids = await _answer(
            engine.tokenize(
                body.prompt,
                [m.as_dict() for m in body.messages] if body.messages is not None else None,
                add_special_tokens=(
                    body.add_special_tokens if body.add_special_tokens is not None else not is_chat
                ),
                add_generation_prompt=body.add_generation_prompt is not False,
                chat_template=body.chat_template,
                chat_template_kwargs=body.chat_template_kwargs,
                tools=body.functions(),
                timeout=TOKENIZER_TIMEOUT_S,
            )
        )
        return _json(
            {
                "count": len(ids),
                "max_model_len": engine.max_model_len,
                "tokens": ids,
                "token_strs": None,
            }
        )

    async def detokenize(request: Request) -> Response:
        body = parse_request(DetokenizeRequest, await request.body())
        _check_model(engine, body.model)
        text = await _answer(engine.detokenize(body.tokens, timeout=TOKENIZER_TIMEOUT_S))
        return _json({"prompt": text})

    router.add_api_route(
        "/tokenize", tokenize, methods=["POST"], openapi_extra=json_body(TokenizeRequest)
    )
    router.add_api_route(
        "/detokenize", detokenize, methods=["POST"], openapi_extra=json_body(DetokenizeRequest)
    )
    return router


async def _answer(pending: Awaitable[T]) -> T:
    """What a tokenizer answered; a retryable 503 when none did (one restarting, say)."""
    try:
        return await pending
    except TimeoutError:
        message = "no tokenizer answered in time; retry the request"
        raise RequestRejected(message, None, 503) from None


def _json(obj: Any) -> Response:
    return Response(orjson.dumps(obj), media_type="application/json")
