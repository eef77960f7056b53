"""The Responses API's request (`POST /v1/responses`) and its translation into the chat
request the engine already serves: nothing below the gateway learns a new protocol.

    input            a string (one user message) or items: messages (role + content, a
                     string or input_text/output_text parts), `function_call` items (an
                     assistant turn's calls) and `function_call_output` items (tool turns)
    instructions     a system message first (not carried into a later response's history)
    previous_response_id   the stored conversation of that response, then `input`
    tools            function tools ({"type": "function", "name", "parameters", ...})
    tool_choice      auto | none | required | {"type": "function", "name"}
    text.format      text | json_object | json_schema ({name, schema, strict}): a grammar
    max_output_tokens, temperature, top_p, parallel_tool_calls, stream, store

Errors name the Responses field (`max_output_tokens`, `text.format`, `input`), not the chat
field it was translated to. Fields that change nothing here (`metadata`, `user`, ...) are
accepted; fields asking for what is not served (`background`, `conversation`, hosted tools)
are refused by name; unknown fields are refused with the name likely meant.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, model_validator

from services.gateway.openai.protocol import MaxTokens, Temperature, TopP
from services.gateway.openai.refused import ANY, check_disjoint, refuse_unsupported
from services.gateway.openai.request_errors import RequestRejected
from services.gateway.openai.unknown_fields import check_unknown

_STRICT = ConfigDict(strict=True, extra="ignore")

# accepted, and change nothing generated
IGNORED_RESPONSE_FIELDS = (
    "metadata", "user", "service_tier", "safety_identifier", "prompt_cache_key",
    "prompt_cache_retention", "stream_options", "include", "reasoning", "truncation",
)  # fmt: skip
# refused when they ask for something (the value that asks for nothing, or ANY)
REFUSED_RESPONSE_FIELDS: dict[str, Any] = {
    "background": False,
    "conversation": ANY,
    "prompt": ANY,
    "max_tool_calls": ANY,
    "top_logprobs": 0,
}
# chat request fields -> the Responses field a refusal names
_RENAMES = {
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "messages": "input",
    "prompt": "input",
}


class ResponsesRequest(BaseModel):
    """Body of POST /v1/responses."""

    model_config = _STRICT
    model: str | None = None
    input: str | list[dict[str, Any]] = Field(default_factory=list)
    instructions: str | None = None
    previous_response_id: Annotated[str, Field(min_length=1, max_length=128)] | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    store: bool | None = None
    stream: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any, info: ValidationInfo) -> Any:
        known = [*REFUSED_RESPONSE_FIELDS, *IGNORED_RESPONSE_FIELDS]
        check_unknown(data, cls, known, cls.__name__, info.context)
        return refuse_unsupported(data, REFUSED_RESPONSE_FIELDS, cls.__name__)

    @property
    def is_stored(self) -> bool:
        return self.store is not False  # (OpenAI's default: stored)


check_disjoint(ResponsesRequest.model_fields, REFUSED_RESPONSE_FIELDS, "ResponsesRequest")


def chat_body(req: ResponsesRequest, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat request body that asks the engine for this response: `history` (a stored
    response's conversation) and the request's input after its instructions."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages += history + input_messages(req.input)
    if not messages:
        raise RequestRejected("input: must not be empty", "input")
    body: dict[str, Any] = {"messages": messages, "stream": bool(req.stream)}
    for field in ("model", "temperature", "top_p", "parallel_tool_calls"):
        if getattr(req, field) is not None:
            body[field] = getattr(req, field)
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    if req.tools:
        body["tools"] = [_chat_tool(i, tool) for i, tool in enumerate(req.tools)]
    if req.tool_choice is not None:
        body["tool_choice"] = _chat_tool_choice(req.tool_choice)
    if req.text is not None:
        body |= _response_format(req.text)
    return body


def history_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's own turns, as a later response's history sees them (no instructions)."""
    return input_messages(req.input)


def renamed(e: RequestRejected) -> RequestRejected:
    """A chat refusal naming the Responses field it came from."""
    if e.param is None:
        return e
    head, _, rest = e.param.partition(".")
    head, sep, index = head.partition("[")
    if head not in _RENAMES:
        return e
    param = _RENAMES[head] + (sep + index if sep else "") + ("." + rest if rest else "")
    message = param + e.message[len(e.param) :] if e.message.startswith(e.param) else e.message
    return RequestRejected(message, param, e.status)


def input_messages(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as chat messages: consecutive function_call items make one assistant turn."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = _function_call(item, where)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not isinstance(output, str):
                raise RequestRejected(
                    f"{where}: a function_call_output needs call_id and output strings", where
                )
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind != "reasoning":  # (an earlier answer's reasoning: not fed back)
            raise RequestRejected(
                f"{where}.type: must be message, function_call or function_call_output, "
                f"got {str(kind)[:40]!r}",
                f"{where}.type",
            )
    return messages


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role, content = item.get("role"), item.get("content")
    if role not in ("user", "system", "developer", "assistant"):
        raise RequestRejected(
            f"{where}.role: must be user, system, developer or assistant", f"{where}.role"
        )
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text") or not isinstance(part.get("text"), str):
                raise RequestRejected(
                    f"{where}.content[{j}]: only input_text and output_text parts are supported",
                    f"{where}.content[{j}]",
                )
            texts.append(part["text"])
        content = "\n".join(texts)
    if not isinstance(content, str):
        raise RequestRejected(
            f"{where}.content: must be a string or a list of text parts", f"{where}.content"
        )
    return {"role": role, "content": content}


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
    if not all(isinstance(v, str) for v in (call_id, name, arguments)):
        raise RequestRejected(
            f"{where}: a function_call needs call_id, name and arguments strings", where
        )
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _chat_tool(index: int, tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise RequestRejected(
            f"tools[{index}].type: only function tools are supported", f"tools[{index}].type"
        )
    function = {k: v for k, v in tool.items() if k != "type"}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(text: dict[str, Any]) -> dict[str, Any]:
    fmt = text.get("format")
    if fmt is None:
        return {}
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise RequestRejected(
            "text.format: must be an object of type text, json_object or json_schema",
            "text.format",
        )
    if fmt["type"] != "json_schema":
        return {"response_format": {"type": fmt["type"]}}
    inner = {k: v for k, v in fmt.items() if k != "type"}
    return {"response_format": {"type": "json_schema", "json_schema": inner}}
