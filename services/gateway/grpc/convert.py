"""shuttle.v1 messages to and from the engine's types, by the HTTP API's rules.

A `GenerateRequest` proto is turned into the body the HTTP API would have received and
validated by the very same pydantic models (services/gateway/openai/*protocol.py), so both APIs
accept, default and refuse exactly alike. Only the field names in messages differ, renamed
to the proto's: `prompt` -> `text` | `token_ids.ids`, `messages` -> `chat.messages`,
`X-Request-Id` -> `request_id`, and chat's `top_logprobs` -> `logprobs` (which asks for
logprobs on every kind of prompt). A field the proto does not declare (a newer client's) is
refused by its number, never dropped.

    HTTP status   gRPC status
    400           INVALID_ARGUMENT      404  NOT_FOUND        429  RESOURCE_EXHAUSTED
    401           UNAUTHENTICATED       503  UNAVAILABLE      other 4xx INVALID_ARGUMENT,
                                                             5xx INTERNAL
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any, cast

import grpc
import orjson
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet

from common.messages import FinishReason, GenerateRequest
from proto import shuttle_pb2 as pb
from services.gateway.engine.client import EngineClient, OutputDelta, TokenLogprob
from services.gateway.openai.chat_protocol import ChatCompletionRequest
from services.gateway.openai.completions_protocol import CompletionRequest
from services.gateway.openai.protocol import REQUEST_ID_PATTERN, lora_of
from services.gateway.openai.request_errors import RequestRejected, validate_request
from services.gateway.openai.tool_stream import ToolStream
from services.gateway.openai.tools import ToolCall, ToolPlan

REQUEST_ID_PREFIX = "gen-"
_OPTIONAL_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "min_tokens",
    "n",
    "priority",
    "timeout",
    "return_token_ids",
    "prompt_logprobs",
)
_STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}
# the HTTP API's field names -> the proto's, per kind of prompt
_COMMON_RENAMES = {"X-Request-Id": "request_id"}
_RENAMES = {
    "text": {"prompt": "text"} | _COMMON_RENAMES,
    "token_ids": {"prompt": "token_ids.ids"} | _COMMON_RENAMES,
    # the tokenizer and the scheduler call any request's prompt `prompt`
    "chat": {
        "messages": "chat.messages",
        "prompt": "chat.messages",
        "chat_template": "chat.chat_template",
        "chat_template_kwargs": "chat.chat_template_kwargs",
        "top_logprobs": "logprobs",  # (chat's top_logprobs is GenerateRequest.logprobs)
        "tools": "chat.tools",
        "tool_choice": "chat.tool_choice",
    }
    | _COMMON_RENAMES,
    None: _COMMON_RENAMES,
}


def status_code(http_status: int) -> grpc.StatusCode:
    """The gRPC status for an HTTP status of the engine or the validation."""
    code = _STATUS_CODES.get(http_status)
    if code is not None:
        return code
    return grpc.StatusCode.INVALID_ARGUMENT if http_status < 500 else grpc.StatusCode.INTERNAL


def renames_for(request: pb.GenerateRequest) -> dict[str, str]:
    """How this request's fields are named in the proto, for error messages."""
    return _RENAMES[request.WhichOneof("prompt")]


def rename_field(message: str, param: str | None, renames: dict[str, str]) -> str:
    """'messages[0].role: must be ...' -> 'chat.messages[0].role: must be ...'."""
    if not param:
        return message
    for old, new in renames.items():
        if param == old or param.startswith((old + "[", old + ".")):
            if message.startswith(param):
                return new + message[len(old) :]
            return message
    return message


def request_id_of(request: pb.GenerateRequest) -> str:
    """The client's id if valid (RequestRejected if not), else a fresh one."""
    if not request.request_id:
        return REQUEST_ID_PREFIX + uuid.uuid4().hex
    check_request_id(request.request_id)
    return request.request_id


def check_request_id(request_id: str) -> None:
    if not REQUEST_ID_PATTERN.fullmatch(request_id):
        raise RequestRejected(
            "request_id: must be 1..128 characters of [A-Za-z0-9._:-]", "request_id"
        )


def to_generate_request(
    request: pb.GenerateRequest,
    request_id: str,
    engine: EngineClient,
    context: dict[str, Any] | None = None,
) -> GenerateRequest:
    """Validate as the HTTP API would (`context`: what the server is set up to do, as
    parse_request takes it) and build the engine's request.

    Raises RequestRejected (status 400, 404 or 503) with the HTTP API's message; the caller
    renames its field with `rename_field`."""
    body = validate_request(*_http_body(request), context=context)
    lora = lora_of(  # the model name selects a LoRA adapter, as over HTTP
        body.model, engine.model_names, engine.lora_adapters, engine.is_ready(), engine.draining
    )
    generate = body.to_generate_request(request_id, engine.model_name, engine.max_model_len)
    return dataclasses.replace(generate, lora_name=lora) if lora else generate


def refuse_unknown_fields(message: Message, path: str = "") -> None:
    """RequestRejected naming the first field this server's proto does not know (a newer
    client's), in `message` or any message inside it: a field the server cannot read would
    otherwise be dropped without a word."""
    for unknown in UnknownFieldSet(message):
        where = f"{path}: " if path else ""
        raise RequestRejected(
            f"{where}field {unknown.field_number}: unknown to this server's "
            f"{message.DESCRIPTOR.full_name}; it is not implemented here",
            f"{path}.{unknown.field_number}" if path else str(unknown.field_number),
        )
    for field, value in message.ListFields():
        if field.message_type is None or field.message_type.GetOptions().map_entry:
            continue  # (a map's entries hold scalars here)
        name = f"{path}.{field.name}" if path else field.name
        if field.is_repeated:
            for i, item in enumerate(value):
                refuse_unknown_fields(item, f"{name}[{i}]")
        else:
            refuse_unknown_fields(value, name)


def tool_plan_of(request: pb.GenerateRequest, context: dict[str, Any] | None) -> ToolPlan | None:
    """The request's tools (None: no tools); the request was validated already."""
    if request.WhichOneof("prompt") != "chat" or not request.chat.tools:
        return None
    body = validate_request(*_http_body(request), context=context)
    assert isinstance(body, ChatCompletionRequest)
    return body.tool_plan


def _http_body(
    request: pb.GenerateRequest,
) -> tuple[type[ChatCompletionRequest] | type[CompletionRequest], dict[str, Any]]:
    """The JSON body the HTTP API would have received for this request (unset = absent)."""
    refuse_unknown_fields(request)
    data: dict[str, Any] = {f: getattr(request, f) for f in _OPTIONAL_FIELDS if request.HasField(f)}
    if request.model:
        data["model"] = request.model
    if request.stop:
        data["stop"] = list(request.stop)
    if request.stop_token_ids:
        data["stop_token_ids"] = list(request.stop_token_ids)
    if request.logit_bias:
        data["logit_bias"] = {str(k): v for k, v in request.logit_bias.items()}
    if request.bad_words:
        data["bad_words"] = list(request.bad_words)
    if request.HasField("structured_outputs"):
        data["structured_outputs"] = _structured_outputs(request.structured_outputs)
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise RequestRejected("prompt: one of text, chat or token_ids is required", "prompt")
    if kind != "chat":
        data["prompt"] = request.text if kind == "text" else list(request.token_ids.ids)
        if request.HasField("logprobs"):
            data["logprobs"] = request.logprobs
        return CompletionRequest, data
    if request.HasField("logprobs"):  # chat asks with a flag and a count
        data["logprobs"], data["top_logprobs"] = True, request.logprobs
    data["messages"] = [_chat_message(m) for m in request.chat.messages]
    if request.chat.HasField("add_generation_prompt"):
        data["add_generation_prompt"] = request.chat.add_generation_prompt
    if request.chat.HasField("chat_template_kwargs"):
        data["chat_template_kwargs"] = MessageToDict(request.chat.chat_template_kwargs)
    if request.chat.HasField("chat_template"):
        data["chat_template"] = request.chat.chat_template
    data |= _tool_fields(request.chat)
    return ChatCompletionRequest, data


def _tool_fields(chat: pb.Chat) -> dict[str, Any]:
    """tools, tool_choice, parallel_tool_calls as the HTTP API's fields."""
    out: dict[str, Any] = {}
    if chat.tools:
        out["tools"] = [_tool(i, t) for i, t in enumerate(chat.tools)]
    if chat.HasField("tool_choice"):
        choice = chat.tool_choice
        named = choice not in ("none", "auto", "required")
        out["tool_choice"] = {"type": "function", "function": {"name": choice}} if named else choice
    if chat.HasField("parallel_tool_calls"):
        out["parallel_tool_calls"] = chat.parallel_tool_calls
    return out


def _tool(index: int, tool: pb.Tool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    if tool.parameters:
        try:
            function["parameters"] = orjson.loads(tool.parameters)
        except orjson.JSONDecodeError as e:
            field = f"chat.tools[{index}].parameters"
            raise RequestRejected(f"{field}: is not valid JSON ({e})", field) from None
    return {"type": "function", "function": function}


def _structured_outputs(spec: pb.StructuredOutputs) -> dict[str, Any]:
    """As the HTTP API's `structured_outputs` (an unset oneof: an empty object, refused by
    the same rule as over HTTP)."""
    kind = spec.WhichOneof("kind")
    if kind is None:
        return {}
    if kind == "choice":
        return {"choice": list(spec.choice.choices)}
    return {kind: getattr(spec, kind)}


def _chat_message(message: pb.ChatMessage) -> dict[str, Any]:
    # an assistant turn that only calls tools has no content (null over HTTP)
    content = message.content or (None if message.tool_calls else message.content)
    out: dict[str, Any] = {"role": message.role, "content": content}
    if message.HasField("name"):
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}}
            for c in message.tool_calls
        ]  # fmt: skip
    if message.HasField("tool_call_id"):
        out["tool_call_id"] = message.tool_call_id
    return out


def wants_token_ids(request: pb.GenerateRequest) -> bool:
    """return_token_ids: unset means true (the stream always carried them)."""
    return not request.HasField("return_token_ids") or request.return_token_ids


def to_response(
    request_id: str,
    delta: OutputDelta,
    fingerprint: str,
    with_token_ids: bool = True,
    tools: ToolStream | None = None,
) -> pb.GenerateResponse:
    """One streamed message of sequence `delta.index`; the sequence's last (finish reason
    set) also carries its usage and the version. With tools (`tools`: the sequence's
    ToolStream), text that may start a call is held back; the last message carries the
    rest of the text and the calls."""
    text = delta.text if tools is None else tools.feed(delta.text).content
    calls: list[ToolCall] = []
    if tools is not None and delta.finish_reason != FinishReason.NONE:
        rest, calls = tools.finish()
        text += rest.content
    response = pb.GenerateResponse(
        request_id=request_id,
        text=text,
        token_ids=delta.token_ids if with_token_ids else (),
        index=delta.index,
        logprobs=[_token_logprob(e) for e in delta.logprobs],
        prompt_logprobs=[_token_logprob(e) for e in delta.prompt_logprobs],
        tool_calls=[pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in calls],
    )
    if delta.finish_reason != FinishReason.NONE:
        # the proto enum's numbers are the engine's FinishReason values (TOOL_CALLS aside)
        finish = int(delta.finish_reason)
        if calls and delta.finish_reason == FinishReason.STOP:
            finish = pb.FINISH_REASON_TOOL_CALLS
        response.finish_reason = cast("pb.FinishReason", finish)
        prompt, output = delta.num_prompt_tokens, delta.num_output_tokens
        response.usage.prompt_tokens = prompt
        response.usage.completion_tokens = output
        response.usage.total_tokens = prompt + output
        response.usage.cached_tokens = delta.num_cached_tokens
        response.system_fingerprint = fingerprint
    return response


def _token_logprob(entry: TokenLogprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=entry.token_id,
        token=entry.token,
        logprob=entry.logprob,
        top_logprobs=[
            pb.TopLogprob(token_id=token_id, token=text, logprob=lp)
            for token_id, text, lp in entry.top
        ],
    )
