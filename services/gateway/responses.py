"""The Responses API: `POST /v1/responses` (streamed or not), `GET` and `DELETE
/v1/responses/{id}`. A request is translated into the chat request the engine serves
(services/gateway/responses_protocol.py); its output comes back as Responses items: a
`message` with one `output_text` part, and a `function_call` item per tool call.

A stream is OpenAI's typed events, each with a `sequence_number`:

    response.created, response.in_progress,
    per item: response.output_item.added,
      message:  response.content_part.added, response.output_text.delta ...,
                response.output_text.done, response.content_part.done
      call:     response.function_call_arguments.delta, ...arguments.done
    response.output_item.done, then response.completed (response.incomplete when
    max_output_tokens cut it)

Text streams as it is generated; with tools or a reasoning parser the output is read whole
first (a call, or where reasoning ends, is known only once the text is complete), then its
items are sent: with `--reasoning-parser`, a `reasoning` item (its text in a
`reasoning_text` part, events response.reasoning_text.delta/done) before the answer.

Stored responses (`store`, true unless false) are kept in this gateway's memory, bounded
(services/gateway/response_store.py); `previous_response_id` continues one.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from common.messages import FinishReason
from services.gateway import sse
from services.gateway.access_log import AccessRecord
from services.gateway.app import (
    KEEPALIVE_S,
    REQUEST_ID_HEADER,
    DeltaReader,
    SseResponse,
    Usage,
    close_shielded,
    collect,
    until_disconnected,
)
from services.gateway.engine_client import EngineClient, RequestFailed
from services.gateway.protocol import (
    REQUEST_ID_PATTERN,
    ChatCompletionRequest,
    RequestRejected,
    check_model,
    parse_request,
    validate_request,
)
from services.gateway.reasoning import split_reasoning
from services.gateway.response_store import ResponseStore, StoredResponse
from services.gateway.responses_protocol import (
    ResponsesRequest,
    chat_body,
    history_messages,
    renamed,
)
from services.gateway.tools import ToolPlan, chat_message


def responses_router(
    engine: EngineClient, context: dict[str, Any] | None, store: ResponseStore | None = None
) -> APIRouter:
    routes = ResponsesRoutes(engine, context, store or ResponseStore())
    router = APIRouter(prefix="/v1")
    router.add_api_route("/responses", routes.create, methods=["POST"])
    router.add_api_route("/responses/{response_id}", routes.get, methods=["GET"])
    router.add_api_route("/responses/{response_id}", routes.delete, methods=["DELETE"])
    return router


class ResponsesRoutes:
    """The route handlers, bound to one engine and one store."""

    def __init__(
        self, engine: EngineClient, context: dict[str, Any] | None, store: ResponseStore
    ) -> None:
        self.engine = engine
        self.context = context
        self.store = store

    async def get(self, response_id: str) -> Response:
        return _json(self._stored(response_id, "response_id").response)

    async def delete(self, response_id: str) -> Response:
        self._stored(response_id, "response_id")
        self.store.delete(response_id)
        return _json({"id": response_id, "object": "response", "deleted": True})

    def _stored(self, response_id: str, param: str) -> StoredResponse:
        stored = self.store.get(response_id)
        if stored is None:
            raise RequestRejected(
                f"{param}: no stored response with id {response_id[:128]!r} (responses are "
                f"kept in memory, the last {self.store.capacity})",
                param,
                404,
            )
        return stored

    async def create(self, request: Request) -> Response:
        response_id = _response_id(request)
        req = parse_request(ResponsesRequest, await request.body(), self.context)
        previous = None
        if req.previous_response_id is not None:
            previous = self._stored(req.previous_response_id, "previous_response_id")
        engine = self.engine
        try:
            body = chat_body(req, previous.history if previous else [])
            chat = validate_request(ChatCompletionRequest, body, self.context)
            check_model(chat.model, engine.model_names, engine.is_ready(), engine.draining)
            generate = chat.to_generate_request(
                response_id, engine.model_name, engine.max_model_len
            )
        except RequestRejected as e:
            raise renamed(e) from None
        request.state.access = record = AccessRecord()
        reader = DeltaReader(engine.generate(generate), "input", record)
        turn = _Turn(response_id, req, engine.model_name, chat.tool_plan, self._store_for(req))
        turn.reasoning = (self.context or {}).get("reasoning_parser", "")
        turn.history = (previous.history if previous else []) + history_messages(req)
        headers = {REQUEST_ID_HEADER: response_id}
        handed_off = False
        try:
            if req.stream:
                first = await until_disconnected(request, reader.next())
                handed_off = True
                return SseResponse(stream_events(reader, first, turn), headers=headers)
            choices, usage = await until_disconnected(request, collect(reader))
            (choice,) = choices
            items = turn.items(choice.text, choice.finish_reason)
            return _json(turn.finish(items, choice.finish_reason, usage), headers=headers)
        finally:
            if not handed_off:
                await close_shielded(reader)

    def _store_for(self, req: ResponsesRequest) -> Callable[[StoredResponse], None] | None:
        return self.store.put if req.is_stored else None


@dataclasses.dataclass(slots=True)
class _Turn:
    """One response being made: what its objects repeat, and where it is stored."""

    response_id: str
    req: ResponsesRequest
    model: str
    plan: ToolPlan | None
    store: Callable[[StoredResponse], None] | None
    created_at: int = dataclasses.field(default_factory=lambda: int(time.time()))
    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    reasoning: str = ""  # --reasoning-parser: a reasoning item before the answer

    def items(self, text: str, reason: FinishReason) -> list[dict[str, Any]]:
        """The output's items (with --reasoning-parser, its reasoning item first)."""
        thought = None
        if self.reasoning:
            thought, text = split_reasoning(text, self.reasoning)
        items = output_items(text, reason, self.plan)
        return items if thought is None else [reasoning_item(thought), *items]

    def response(self, status: str = "in_progress", **fields: Any) -> dict[str, Any]:
        req = self.req
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": [],
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "tools": req.tools or [],
            "tool_choice": "auto" if req.tool_choice is None else req.tool_choice,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "text": req.text or {"format": {"type": "text"}},
            "previous_response_id": req.previous_response_id,
            "store": req.is_stored,
            "truncation": "disabled",
            "metadata": {},
            "error": None,
            "incomplete_details": None,
            "usage": None,
        } | fields

    def finish(self, items: list[dict[str, Any]], reason: FinishReason, usage: Usage) -> dict:
        """The finished response (stored when asked)."""
        cut = reason == FinishReason.LENGTH
        prompt, output = usage.num_prompt_tokens, usage.num_output_tokens
        response = self.response(
            "incomplete" if cut else "completed",
            output=items,
            incomplete_details={"reason": "max_output_tokens"} if cut else None,
            usage={
                "input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": output,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + output,
            },
        )
        if self.store is not None:
            self.store(StoredResponse(response, self.history + [_assistant_turn(items)]))
        return response


def output_items(text: str, reason: FinishReason, plan: ToolPlan | None) -> list[dict[str, Any]]:
    """The output's items: a message with its text (unless only calls were made), then
    one function_call item per tool call."""
    message, _ = chat_message(text, reason.openai, plan)
    calls = message.get("tool_calls") or []
    items = [] if calls and not message["content"] else [message_item(message["content"] or "")]
    for call in calls:
        items.append(
            {
                "type": "function_call",
                "id": "fc_" + uuid.uuid4().hex,
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
                "status": "completed",
            }
        )
    return items


def reasoning_item(text: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": "rs_" + uuid.uuid4().hex,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": "completed",
    }


def message_item(text: str, status: str = "completed", item_id: str = "") -> dict[str, Any]:
    content = [_text_part(text)] if status == "completed" else []
    return {
        "type": "message",
        "id": item_id or "msg_" + uuid.uuid4().hex,
        "status": status,
        "role": "assistant",
        "content": content,
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _assistant_turn(items: list[dict[str, Any]]) -> dict[str, Any]:
    """The output as the chat message a later turn's history holds."""
    text = "".join(p["text"] for i in items if i["type"] == "message" for p in i["content"])
    calls = [
        {"id": i["call_id"], "type": "function", "function": _function(i)}
        for i in items
        if i["type"] == "function_call"
    ]
    turn: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    return turn | ({"tool_calls": calls} if calls else {})


def _function(item: dict[str, Any]) -> dict[str, Any]:
    return {"name": item["name"], "arguments": item["arguments"]}


# --- the stream -----------------------------------------------------------------------------


async def stream_events(
    reader: DeltaReader, first: Any, turn: _Turn
) -> AsyncGenerator[bytes, None]:
    """The SSE body (see the module's docstring); a failure is an `error` event."""
    numbers = itertools.count()

    def event(kind: str, **fields: Any) -> bytes:
        return sse.sse_event({"type": kind, "sequence_number": next(numbers)} | fields)

    try:
        yield event("response.created", response=turn.response())
        yield event("response.in_progress", response=turn.response())
        usage, text, reason = Usage(1), [], FinishReason.NONE
        # text streams as it comes; with tools or reasoning, the items once it is whole
        live = turn.plan is None and not turn.reasoning
        item = message_item("", "in_progress")
        if live:
            yield event("response.output_item.added", output_index=0, item=item)
            yield event(**_part_event("added", item, ""))
        delta = first
        while True:
            usage.add(delta)
            text.append(delta.text)
            if live and delta.text:
                yield event(
                    "response.output_text.delta", **_where(item), delta=delta.text, logprobs=[]
                )
            reason = delta.finish_reason if delta.finish_reason != FinishReason.NONE else reason
            if delta.last:
                break
            while True:
                try:
                    delta = await reader.next(KEEPALIVE_S)
                    break
                except TimeoutError:
                    yield sse.sse_comment("keep-alive")
        whole = "".join(text)
        if live:
            items = [message_item(whole, item_id=item["id"])]
            yield event("response.output_text.done", **_where(item), text=whole, logprobs=[])
            yield event(**_part_event("done", item, whole))
            yield event("response.output_item.done", output_index=0, item=items[0])
        else:
            items = turn.items(whole, reason)
            for index, done in enumerate(items):
                for out in _item_events(index, done):
                    yield event(**out)
        response = turn.finish(items, reason, usage)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        yield event(kind, response=response)
    except RequestFailed as e:
        yield event("error", code=str(e.status), message=e.message, param=e.param)
    finally:
        await close_shielded(reader)


def _where(item: dict[str, Any], index: int = 0) -> dict[str, Any]:
    return {"item_id": item["id"], "output_index": index, "content_index": 0}


def _part_event(stage: str, item: dict[str, Any], text: str, index: int = 0) -> dict[str, Any]:
    part = _text_part(text)
    return _where(item, index) | {"kind": f"response.content_part.{stage}", "part": part}


def _item_events(index: int, item: dict[str, Any]) -> list[dict[str, Any]]:
    """A whole item's events, its text or arguments in one delta."""
    where = {"output_index": index}
    if item["type"] == "message":
        text = item["content"][0]["text"]
        added = item | {"status": "in_progress", "content": []}
        at = _where(item, index)
        return [
            {"kind": "response.output_item.added", "item": added} | where,
            _part_event("added", item, "", index),
            at | {"kind": "response.output_text.delta", "delta": text, "logprobs": []},
            at | {"kind": "response.output_text.done", "text": text, "logprobs": []},
            _part_event("done", item, text, index),
            {"kind": "response.output_item.done", "item": item} | where,
        ]
    if item["type"] == "reasoning":
        text, at = item["content"][0]["text"], _where(item, index)
        return [
            {"kind": "response.output_item.added", "item": item | {"content": []}} | where,
            at | {"kind": "response.reasoning_text.delta", "delta": text},
            at | {"kind": "response.reasoning_text.done", "text": text},
            {"kind": "response.output_item.done", "item": item} | where,
        ]
    added = item | {"status": "in_progress", "arguments": ""}
    at = {"item_id": item["id"]} | where
    return [
        {"kind": "response.output_item.added", "item": added} | where,
        at | {"kind": "response.function_call_arguments.delta", "delta": item["arguments"]},
        at | {"kind": "response.function_call_arguments.done", "arguments": item["arguments"]},
        {"kind": "response.output_item.done", "item": item} | where,
    ]


def _response_id(request: Request) -> str:
    """The client's X-Request-Id when valid (as the other routes), else a fresh resp_ id."""
    request_id = request.headers.get(REQUEST_ID_HEADER)
    if request_id is None:
        request_id = "resp_" + uuid.uuid4().hex
    elif not REQUEST_ID_PATTERN.fullmatch(request_id):
        raise RequestRejected(
            f"{REQUEST_ID_HEADER}: must be 1..128 characters of [A-Za-z0-9._:-]",
            REQUEST_ID_HEADER,
        )
    request.state.request_id = request_id
    return request_id


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(obj), status, headers, media_type="application/json")
