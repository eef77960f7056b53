"""The body of POST /v1/chat/completions and its conversion to a `GenerateRequest`: the fields
every generate body shares, their checks and their limits are services/gateway/openai/protocol.py's
(its docstring says how strict parsing is, the defaults and the limits); here what chat adds:
`messages`, `max_completion_tokens`, tools, the chat template and its kwargs, `logprobs` /
`top_logprobs`, vLLM's `add_generation_prompt`, `continue_final_message` and `echo`."""

from __future__ import annotations

import dataclasses
import time
from typing import Annotated, Any

import orjson
from pydantic import (
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from common.limits import (
    MAX_CHAT_TEMPLATE_CHARS,
)
from common.messages import GenerateRequest
from services.gateway.openai.chat_messages import ChatMessage
from services.gateway.openai.protocol import MaxTokens, NumLogprobs, _CommonRequest, _refuse
from services.gateway.openai.reasoning import THINK_END
from services.gateway.openai.refused import (
    IGNORED_FIELDS,
    REFUSED_CHAT,
    check_disjoint,
    refuse_unsupported,
)
from services.gateway.openai.request_errors import RequestRejected
from services.gateway.openai.structured import (
    StructuredError,
)
from services.gateway.openai.tools import ToolPlan, forced_grammar, plan_tools
from services.gateway.openai.unknown_fields import check_unknown

ChatTemplate = Annotated[str, Field(min_length=1, max_length=MAX_CHAT_TEMPLATE_CHARS)]


def trusted_chat_template(value: str | None, info: ValidationInfo) -> str | None:
    """A request's `chat_template`: as vLLM, a client's template runs on the server only if
    the operator allows it (parse_request's context says so)."""
    if value is not None and not (info.context or {}).get("trust_request_chat_template"):
        raise _refuse("needs --trust-request-chat-template on this server")
    return value


def bounded_template_kwargs(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """A request's `chat_template_kwargs`: bounded, and carried by orjson to the tokenizer."""
    if value is None:
        return value
    try:
        size = len(orjson.dumps(value))
    except orjson.JSONEncodeError:
        raise _refuse("integers must fit in 64 bits") from None
    if size > MAX_CHAT_TEMPLATE_CHARS:
        raise _refuse(f"at most {MAX_CHAT_TEMPLATE_CHARS} bytes of JSON")
    return value


class ChatCompletionRequest(_CommonRequest):
    """Body of POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: MaxTokens | None = None  # OpenAI's newer name for max_tokens
    add_generation_prompt: bool | None = None  # vLLM extension
    echo: bool | None = None  # vLLM extension: the answer starts with the last message's text
    continue_final_message: bool | None = None  # vLLM extension (add_generation_prompt false)
    # vLLM extensions: the request's own Jinja template (with --trust-request-chat-template)
    # and extra variables for the template, e.g. {"enable_thinking": false}
    chat_template: ChatTemplate | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: NumLogprobs | None = None
    # tool calling (services/gateway/openai/tools.py)
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    _tool_plan: ToolPlan | None = PrivateAttr(default=None)
    _reasoning_parser: str = PrivateAttr(default="")

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any, info: ValidationInfo) -> Any:
        known = [*REFUSED_CHAT, *IGNORED_FIELDS]
        check_unknown(data, cls, known, cls.__name__, info.context)
        return refuse_unsupported(data, REFUSED_CHAT, cls.__name__)

    @model_validator(mode="after")
    def _plan_tools(self, info: ValidationInfo) -> ChatCompletionRequest:
        # parse_request's context names the server's --tool-call-parser
        parser = (info.context or {}).get("tool_call_parser", "hermes")
        # --reasoning-parser: a structured output's grammar starts once the reasoning ends
        self._reasoning_parser = (info.context or {}).get("reasoning_parser", "")
        try:
            self._tool_plan = plan_tools(
                self.tools, self.tool_choice, self.parallel_tool_calls, parser
            )
        except StructuredError as e:  # (a RequestRejected is not wrapped by pydantic)
            raise RequestRejected(str(e), e.field) from None
        return self

    @field_validator("continue_final_message")
    @classmethod
    def _continue_or_prompt(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        # as vLLM: add_generation_prompt (true unless said) opens a new turn; both is a mistake
        if value and info.data.get("add_generation_prompt") is not False:
            raise _refuse("needs add_generation_prompt: false (both cannot be true)")
        return value

    @property
    def echo_text(self) -> str:
        """vLLM's chat `echo`: the last message's content, which the answer's content starts
        with, when that message has the answer's role (assistant; with
        add_generation_prompt false, the last message's own role); else ""."""
        last = self.messages[-1]
        role = "assistant" if self.add_generation_prompt is not False else last.role
        return (last.content or "") if self.echo and last.role == role else ""

    @property
    def tool_plan(self) -> ToolPlan | None:
        """The request's tools and how to read its output (None: no tools)."""
        return self._tool_plan

    _trusted_template = field_validator("chat_template")(trusted_chat_template)
    _bounded_kwargs = field_validator("chat_template_kwargs")(bounded_template_kwargs)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        # as vLLM: alternatives without the tokens' own logprobs are a mistake
        if value and not info.data.get("logprobs"):
            raise _refuse("needs logprobs: true")
        return value

    @property
    def num_logprobs(self) -> int | None:
        """Top logprobs per output token (None: none asked)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def to_generate_requests(
        self, request_id: str, model: str, max_model_len: int
    ) -> list[GenerateRequest]:
        return [self.to_generate_request(request_id, model, max_model_len)]

    def to_generate_request(
        self, request_id: str, model: str, max_model_len: int
    ) -> GenerateRequest:
        # as vLLM does: the newer name wins when both are given
        field = "max_completion_tokens" if self.max_completion_tokens else "max_tokens"
        max_tokens = self.max_completion_tokens or self.max_tokens
        plan = self._tool_plan
        forced = forced_grammar(plan) if plan is not None else None
        sampling = self._sampling(
            max_tokens, field, 0, max_model_len, self.num_logprobs, self.prompt_logprobs, forced
        )
        if self._reasoning_parser and sampling.is_structured:
            sampling = dataclasses.replace(sampling, structured_after=THINK_END)
        return GenerateRequest(
            request_id=request_id,
            model=model,
            sampling=sampling,
            messages=[m.as_dict() for m in self.messages],
            tools=list(plan.tools.values()) if plan is not None else None,
            add_generation_prompt=self.add_generation_prompt is not False,
            chat_template=self.chat_template,
            chat_template_kwargs=self.chat_template_kwargs,
            continue_final_message=bool(self.continue_final_message),
            arrival_time=time.time(),
            **self._scheduling(max_model_len),
        )


# a field is honoured (declared above) or refused (services/gateway/openai/refused.py), not both
check_disjoint(ChatCompletionRequest.model_fields, REFUSED_CHAT, "ChatCompletionRequest")
