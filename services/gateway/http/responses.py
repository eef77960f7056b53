"""The Responses API: `POST /v1/responses` (streamed or not), `GET` and `DELETE
/v1/responses/{id}`. A request is translated into the chat request the engine serves
(services/gateway/openai/responses_protocol.py); its output comes back as Responses items: a
`message` with one `output_text` part, and a `function_call` item per tool call.

A stream is OpenAI's typed events, each with a `sequence_number`:

    response.created, response.in_progress,
    per item: response.output_item.added,
      message:  response.content_part.added, response.output_text.delta ...,
                response.output_text.done, response.content_part.done
      call:     response.function_call_arguments.delta, ...arguments.done
    response.output_item.done, then response.completed (response.incomplete when
    max_output_tokens cut it)

      reasoning (--reasoning-parser, before the message): response.reasoning_text.delta
                ..., response.reasoning_text.done

Text streams as it is generated (services/gateway/http/responses_stream.py); with tools the
output is read whole first (a call is known only once its text is complete), then its items
are sent. Items are built in services/gateway/openai/responses_items.py.

Stored responses (`store`, true unless false) are kept in this gateway's memory, bounded
(services/gateway/http/response_store.py); `previous_response_id` continues one.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable
from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from common.messages import FinishReason
from services.gateway.engine.client import EngineClient
from services.gateway.http.access_log import AccessRecord
from services.gateway.http.deltas import (
    DeltaReader,
    Usage,
    close_shielded,
    collect,
    until_disconnected,
)
from services.gateway.http.errors import REQUEST_ID_HEADER
from services.gateway.http.response_store import ResponseStore, StoredResponse, StoresResponses
from services.gateway.http.responses_stream import stream_events
from services.gateway.http.streaming import SseResponse
from services.gateway.openai.chat_protocol import ChatCompletionRequest
from services.gateway.openai.protocol import REQUEST_ID_PATTERN, lora_of
from services.gateway.openai.reasoning import split_reasoning
from services.gateway.openai.request_errors import RequestRejected, parse_request, validate_request
from services.gateway.openai.responses_items import assistant_turn, output_items, reasoning_item
from services.gateway.openai.responses_protocol import (
    ResponsesRequest,
    chat_body,
    history_messages,
    renamed,
)
from services.gateway.openai.tools import ToolPlan


def responses_router(
    engine: EngineClient, context: dict[str, Any] | None, store: StoresResponses | None = None
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
        self, engine: EngineClient, context: dict[str, Any] | None, store: StoresResponses
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
                f"{param}: no stored response with id {response_id[:128]!r} (the last "
                f"{self.store.capacity} responses are kept)",
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
            lora = lora_of(
                chat.model,
                engine.model_names,
                engine.lora_adapters,
                engine.is_ready(),
                engine.draining,
            )
            generate = chat.to_generate_request(
                response_id, engine.model_name, engine.max_model_len
            )
            generate = dataclasses.replace(generate, lora_name=lora)
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
                "input_tokens_details": {"cached_tokens": usage.num_cached_tokens},
                "output_tokens": output,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + output,
            },
        )
        if self.store is not None:
            self.store(StoredResponse(response, self.history + [assistant_turn(items)]))
        return response


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
