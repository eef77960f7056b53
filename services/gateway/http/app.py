"""The gateway's HTTP front end: OpenAI-compatible routes over an `EngineClient`.

    POST /v1/chat/completions   POST /v1/completions   (streaming or not)
    GET  /v1/models             GET  /health, /ping     GET /version
    POST /tokenize              POST /detokenize       (services/gateway/http/tokenize_routes.py)

Every error is OpenAI-shaped, `{"error": {"message", "type", "param", "code"}}`, with a 4xx
that names the field (never FastAPI's 422). A request keeps one id from the first byte to
the last: the client's `X-Request-Id` if valid, else a fresh one; the response echoes it in
that header (refusals too), and the body's `id` is it with vLLM's `chatcmpl-` / `cmpl-` prefix.

With `n` > 1 the engine interleaves the deltas of n sequences (`OutputDelta.index`); the
answer has n choices, and a stream carries one choice per chunk, as OpenAI's does: the chat
role chunks of every index first, then text and finish chunks per index as they come, then
usage (prompt counted once, outputs summed) and [DONE] once the last sequence finished. A
batch of prompts (/v1/completions) is one engine request per prompt, merged into one such
stream with choices numbered prompt-major (services/gateway/engine/batch.py).

A request ends in the engine whenever its HTTP exchange ends: the engine's delta iterator is
closed (which aborts the request there) when a client disconnects, a stream is dropped, or a
handler fails, in a `finally` that cancellation cannot skip.
"""

from __future__ import annotations

import dataclasses
import hmac
import importlib.metadata
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, Literal, TypeVar

import anyio
import orjson
from fastapi import APIRouter, Depends, FastAPI, Request
from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from common.config import SchedulerConfig, ServerConfig
from common.messages import FinishReason, GenerateRequest
from services.gateway.engine.batch import merge_deltas
from services.gateway.engine.client import EngineClient, OutputDelta, RequestFailed
from services.gateway.http import sse
from services.gateway.http.admin import admin_router
from services.gateway.http.body_limits import BodyLimitMiddleware, BodyLimits
from services.gateway.http.chat import ChatReply
from services.gateway.http.completions import CompletionReply
from services.gateway.http.deltas import (
    DeltaReader,
    Usage,
    close_shielded,
    collect,
    until_disconnected,
)
from services.gateway.http.errors import REQUEST_ID_HEADER, error_type, install_error_handlers
from services.gateway.http.metrics import install_metrics
from services.gateway.http.openapi import json_body
from services.gateway.http.reply import Reply
from services.gateway.http.tokenize_routes import tokenize_router
from services.gateway.openai.logprobs import ChoiceLogprobs
from services.gateway.openai.protocol import (
    REQUEST_ID_PATTERN,
    ChatCompletionRequest,
    CompletionRequest,
    RequestRejected,
    check_model,
    parse_request,
)
from services.gateway.openai.tool_stream import ToolStream

log = logging.getLogger("shuttle.gateway")

KEEPALIVE_S = 15.0  # an SSE comment after this long without a delta keeps proxies patient
_REQUEST_ID = REQUEST_ID_PATTERN
T = TypeVar("T")


def _package_version() -> str:
    try:
        return importlib.metadata.version("shuttle")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "0+unknown"


SERVER_VERSION = _package_version()


def create_app(
    engine: EngineClient,
    server: ServerConfig | None = None,
    scheduler: SchedulerConfig | None = None,
) -> FastAPI:
    """The HTTP app, set up by the config's server section: with `api_key`, every /v1
    route wants `Authorization: Bearer <key>`; /admin routes want the admin token (and are
    all refused without one); request bodies are bounded by its limits. The scheduler
    section says which request fields the engine will honour (`priority`)."""
    server = server or ServerConfig()
    scheduler = scheduler or SchedulerConfig()
    api_key, admin_token = server.api_key or None, server.admin_token or None
    app = FastAPI(title="shuttle", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    limits = BodyLimits(server.max_request_bytes, server.request_body_timeout)
    app.add_middleware(BodyLimitMiddleware, limits=limits)
    context = {
        "scheduling_policy": scheduler.scheduling_policy,
        "trust_request_chat_template": server.trust_request_chat_template,
        "tool_call_parser": server.tool_call_parser,
    }
    routes = OpenAIRoutes(engine, context)
    auth = [Depends(_require_key(api_key))] if api_key else []
    v1 = APIRouter(prefix="/v1", dependencies=auth)
    v1.add_api_route(
        "/chat/completions",
        routes.chat_completions,
        methods=["POST"],
        openapi_extra=json_body(ChatCompletionRequest),
    )
    v1.add_api_route(
        "/completions",
        routes.completions,
        methods=["POST"],
        openapi_extra=json_body(CompletionRequest),
    )
    v1.add_api_route("/models", routes.models, methods=["GET"])
    app.include_router(v1)
    app.include_router(tokenize_router(engine, context), dependencies=auth)
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/ping", routes.health, methods=["GET", "POST"])  # vLLM's alias
    app.add_api_route("/version", routes.version, methods=["GET"])
    app.include_router(admin_router(engine, admin_token, server.model_root or None))
    # GET /metrics, and the engine's request timers
    install_metrics(app, engine, server.metrics_vllm_names)
    return app


@dataclasses.dataclass(frozen=True, slots=True)
class _Api:
    kind: Literal["chat", "completion"]
    id_prefix: str
    body: type[ChatCompletionRequest] | type[CompletionRequest]
    prompt_field: str  # what the tokenizer's and the scheduler's refusals call `prompt`


_CHAT = _Api("chat", "chatcmpl-", ChatCompletionRequest, "messages")
_COMPLETION = _Api("completion", "cmpl-", CompletionRequest, "prompt")


class OpenAIRoutes:
    """The route handlers, bound to one engine."""

    def __init__(self, engine: EngineClient, context: dict[str, Any] | None = None) -> None:
        self.engine = engine
        self.context = context  # what request validation needs to know about the server
        self.created = int(time.time())

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, _CHAT)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, _COMPLETION)

    async def models(self) -> Response:
        """One card per name the served model answers to (none while starting)."""
        engine = self.engine
        cards = [
            {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": "shuttle",
                "root": engine.model_name,
                "max_model_len": engine.max_model_len,
                "version": engine.system_fingerprint,
                "swap_in_progress": engine.swap_status,
            }
            for name in engine.model_names
        ]
        return _json({"object": "list", "data": cards})

    async def version(self) -> Response:
        return _json({"version": SERVER_VERSION})

    async def health(self) -> Response:
        if self.engine.is_ready():
            return _json({"status": "ok"})
        return _json({"status": "not ready"}, 503)

    async def _generate(self, request: Request, api: _Api) -> Response:
        request_id = _request_id(request, api.id_prefix)
        body = parse_request(api.body, await request.body(), self.context)
        engine = self.engine
        check_model(body.model, engine.model_names, engine.is_ready())
        requests = body.to_generate_requests(request_id, engine.model_name, engine.max_model_len)
        n = requests[0].sampling.n  # choices per prompt
        echo = isinstance(body, CompletionRequest) and bool(body.echo)
        lp = ChoiceLogprobs(
            api.kind,
            body.num_logprobs,
            echo_texts=[await self._prompt_text(r) for r in requests] if echo else None,
            with_prompt_logprobs=body.prompt_logprobs is not None,
            n=n,
        )
        ids = (_response_id(request_id, api.id_prefix), engine.model_name, int(time.time()))
        reply: Reply
        if isinstance(body, ChatCompletionRequest):
            reply = ChatReply(
                *ids, engine.system_fingerprint, n * len(requests), n, lp, tools=body.tool_plan
            )
        else:
            reply = CompletionReply(*ids, engine.system_fingerprint, n * len(requests), n, lp)
        if len(requests) == 1:
            deltas = engine.generate(requests[0])
        else:  # a batch of prompts: one engine request each, merged into one answer
            deltas = merge_deltas([engine.generate(r) for r in requests], n)
        reader = DeltaReader(deltas, api.prompt_field)
        headers = {REQUEST_ID_HEADER: request_id}
        handed_off = False
        try:
            if body.stream:
                # the first delta before the first byte: a refusal is still an HTTP status
                first = await until_disconnected(request, reader.next())
                handed_off = True
                # system_fingerprint: the model version that serves this request
                reply = dataclasses.replace(reply, fingerprint=first.version or reply.fingerprint)
                stream = sse_stream(reader, first, reply, body.include_usage)
                return SseResponse(stream, headers=headers | _SSE_HEADERS)
            choices, usage = await until_disconnected(request, collect(reader, n, lp))
            reply = dataclasses.replace(reply, fingerprint=reader.version or reply.fingerprint)
            return _json(reply.body(choices, usage, bool(body.return_token_ids)), headers=headers)
        finally:
            if not handed_off:
                await close_shielded(reader)

    async def _prompt_text(self, request: GenerateRequest) -> str:
        """What echo shows of a completion prompt: its text, or its token ids decoded."""
        if request.prompt is not None:
            return request.prompt
        return await self.engine.detokenize(request.prompt_token_ids or [])


def _request_id(request: Request, prefix: str) -> str:
    request_id = request.headers.get(REQUEST_ID_HEADER)
    if request_id is None:
        request_id = prefix + uuid.uuid4().hex
    elif not _REQUEST_ID.fullmatch(request_id):
        raise RequestRejected(
            f"{REQUEST_ID_HEADER}: must be 1..128 characters of [A-Za-z0-9._:-]",
            REQUEST_ID_HEADER,
        )
    request.state.request_id = request_id  # the error handlers echo it too
    return request_id


def _response_id(request_id: str, prefix: str) -> str:
    """The body's `id`: the request id with vLLM's prefix (`chatcmpl-`, `cmpl-`), which an
    id the gateway made already has."""
    return request_id if request_id.startswith(prefix) else prefix + request_id


def _require_key(api_key: str) -> Callable[[Request], Awaitable[None]]:
    expected = f"Bearer {api_key}".encode()

    async def require_key(request: Request) -> None:
        got = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(got, expected):  # constant time: no key guessing by timing
            raise RequestRejected(
                "invalid or missing API key; send 'Authorization: Bearer <key>'", None, 401
            )

    return require_key


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def sse_stream(
    reader: DeltaReader, first: OutputDelta, reply: Reply, include_usage: bool
) -> AsyncGenerator[bytes, None]:
    """The SSE body: [role chunks], text and finish chunks per choice, [usage chunk], [DONE].
    A failure after the first byte becomes an error event, still followed by [DONE]."""
    try:
        for event in reply.head():
            yield event
        usage = Usage(reply.n_per_prompt)
        delta = first
        seen: set[int] = set()  # choices that had a delta
        tools: dict[int, ToolStream | None] = {}  # with tools: each choice's calls held back
        while True:
            usage.add(delta)
            calls: list[dict[str, Any]] = []
            if delta.index not in tools:
                tools[delta.index] = reply.tool_stream()
            stream = tools[delta.index]
            if stream is not None:
                piece = stream.feed(delta.text)
                delta, calls = dataclasses.replace(delta, text=piece.content), piece.deltas
            for event in reply.delta(delta, first=delta.index not in seen):
                yield event
            for event in reply.call_events(calls, delta.index):
                yield event
            seen.add(delta.index)
            if delta.finish_reason != FinishReason.NONE:
                called = False
                if stream is not None:
                    events, called = reply.tool_events(stream, delta.index)
                    for event in events:
                        yield event
                yield reply.finish(delta.finish_reason, delta.index, called)
            if delta.last:
                break
            while True:
                try:
                    delta = await reader.next(KEEPALIVE_S)
                    break
                except TimeoutError:
                    yield sse.sse_comment("keep-alive")
        if include_usage:
            yield reply.usage(usage)
    except RequestFailed as e:
        yield sse.sse_event(sse.error_chunk(e.message, error_type(e.status), e.status, e.param))
    except Exception:
        log.exception("stream %s failed", reply.request_id)
        yield sse.sse_event(sse.error_chunk("internal error", error_type(500), 500))
    finally:
        await close_shielded(reader)
    yield sse.SSE_DONE


class SseResponse(StreamingResponse):
    """A text/event-stream response that always closes its body generator, so the engine
    hears of the end even when the client leaves between two chunks (servers on ASGI 2.4
    raise from send() and would leave the generator to the garbage collector)."""

    media_type = "text/event-stream"

    def __init__(
        self, events: AsyncGenerator[bytes, None], headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(events, headers=headers)
        self._events = events  # what body_iterator holds, typed as the generator it is

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:  # a client leaving mid-stream is routine, not an app error
            log.debug("client left stream %s", self.headers.get(REQUEST_ID_HEADER))
        finally:
            with anyio.CancelScope(shield=True):
                await self._events.aclose()


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(obj), status, headers, media_type="application/json")
