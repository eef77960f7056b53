"""The gateway's HTTP front end: OpenAI-compatible routes over an `EngineClient`.

    POST /v1/chat/completions   POST /v1/completions   (streaming or not)
    GET  /v1/models, /v1/models/{id}   GET /health, /ping   GET /version
    POST /tokenize              POST /detokenize       (services/gateway/http/tokenize_routes.py)
    POST /v1/embeddings         (services/gateway/http/embeddings.py)
    POST /v1/responses          GET, DELETE /v1/responses/{id}   (http/responses.py)

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
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

import orjson
from fastapi import APIRouter, Depends, FastAPI, Request
from starlette.responses import Response

from common.config import SchedulerConfig, ServerConfig
from common.messages import GenerateRequest
from services.gateway.engine.batch import merge_deltas
from services.gateway.engine.beam_search import beam_answers
from services.gateway.engine.beam_search import finish_reason as beam_finish_reason
from services.gateway.engine.client import EngineClient, OutputDelta
from services.gateway.http.access_log import AccessLogMiddleware, AccessRecord
from services.gateway.http.admin import admin_router
from services.gateway.http.body_limits import BodyLimitMiddleware, BodyLimits
from services.gateway.http.chat import ChatReply
from services.gateway.http.completions import CompletionReply
from services.gateway.http.console import install_console
from services.gateway.http.deltas import (
    Choice,
    DeltaReader,
    Usage,
    close_shielded,
    collect,
    until_disconnected,
)
from services.gateway.http.embeddings import embeddings_router
from services.gateway.http.errors import (
    REQUEST_ID_HEADER,
    install_error_handlers,
    take_request_id,
)
from services.gateway.http.lora_routes import lora_router
from services.gateway.http.metrics import install_metrics
from services.gateway.http.openapi import json_body
from services.gateway.http.reply import Reply
from services.gateway.http.response_store import FileResponseStore, StoresResponses
from services.gateway.http.responses import responses_router
from services.gateway.http.streaming import SSE_HEADERS, SseResponse, sse_stream
from services.gateway.http.tokenize_routes import tokenize_router
from services.gateway.openai.best_of import best_choices
from services.gateway.openai.chat_protocol import ChatCompletionRequest
from services.gateway.openai.completions_protocol import CompletionRequest
from services.gateway.openai.logprobs import ChoiceLogprobs
from services.gateway.openai.protocol import lora_of
from services.gateway.openai.request_errors import RequestRejected, parse_request
from services.gateway.openai.token_output import shaped

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
        "ignore_unknown_fields": server.ignore_unknown_fields,
        "reasoning_parser": server.reasoning_parser,
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
    v1.add_api_route("/models/{model_id:path}", routes.model, methods=["GET"])
    app.include_router(v1)
    app.include_router(tokenize_router(engine, context), dependencies=auth)
    pooling = (server.pooling, server.embedding_normalize)
    app.include_router(embeddings_router(engine, context, *pooling), dependencies=auth)
    app.include_router(
        responses_router(engine, context, _response_store(server)), dependencies=auth
    )
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/ping", routes.health, methods=["GET", "POST"])  # vLLM's alias
    app.add_api_route("/version", routes.version, methods=["GET"])
    app.include_router(admin_router(engine, admin_token, server.model_root or None))
    app.include_router(lora_router(engine, admin_token, server.model_root or None))
    # GET /metrics, and the engine's request timers
    install_metrics(app, engine, server.metrics_vllm_names)
    # GET /console and its feed /admin/events (after /metrics: it chains the request observer)
    install_console(app, engine, admin_token)
    if server.access_log:  # added last: outermost, it sees every refusal
        app.add_middleware(AccessLogMiddleware)
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
        """One card per name the served model answers to (none while starting), then one
        per LoRA adapter (vLLM's: `root` its folder, `parent` the base model)."""
        cards = [self._card(name) for name in self.engine.model_names]
        if cards:
            cards += [self._lora_card(name) for name in self.engine.lora_adapters]
        return _json({"object": "list", "data": cards})

    async def model(self, model_id: str) -> Response:
        """GET /v1/models/{id}: the card of a name the model answers to, else a 404."""
        if model_id in self.engine.model_names:
            return _json(self._card(model_id))
        if self.engine.model_names and model_id in self.engine.lora_adapters:
            return _json(self._lora_card(model_id))
        raise RequestRejected(f"model: the model `{model_id}` does not exist", "model", 404)

    def _lora_card(self, name: str) -> dict[str, Any]:
        return self._card(name) | {
            "root": self.engine.lora_adapters[name],
            "parent": self.engine.model_name,
        }

    def _card(self, name: str) -> dict[str, Any]:
        engine = self.engine
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "shuttle",
            "root": engine.model_name,
            "parent": None,  # (vLLM's: a LoRA adapter's card names its base model)
            "max_model_len": engine.max_model_len,
            "version": engine.system_fingerprint,
            "swap_in_progress": engine.swap_status,
        }

    async def version(self) -> Response:
        return _json({"version": SERVER_VERSION})

    async def health(self) -> Response:
        if self.engine.is_ready():
            return _json({"status": "ok"})
        return _json({"status": "draining" if self.engine.draining else "not ready"}, 503)

    async def _generate(self, request: Request, api: _Api) -> Response:
        request_id = take_request_id(request, api.id_prefix)
        body = parse_request(api.body, await request.body(), self.context)
        engine = self.engine
        lora = lora_of(  # a `model` that names a LoRA adapter runs with it
            body.model, engine.model_names, engine.lora_adapters, engine.is_ready(), engine.draining
        )
        requests = body.to_generate_requests(request_id, engine.model_name, engine.max_model_len)
        if lora:
            requests = [dataclasses.replace(r, lora_name=lora) for r in requests]
        n = requests[0].sampling.n  # choices per prompt
        reply = await self._reply(request_id, body, requests, lora or engine.model_name)
        headers = {REQUEST_ID_HEADER: request_id}
        if body.use_beam_search:  # (services/gateway/engine/beam_search.py)
            choices, usage = await until_disconnected(request, self._beams(body, requests))
            if reply.lp is not None:
                reply.lp.num_logprobs = None  # (the beams' logprobs are not reported)
            return _json(reply.body(choices, usage, body.with_token_ids), headers=headers)
        if len(requests) == 1:
            deltas = engine.generate(requests[0])
        else:  # a batch of prompts: one engine request each, merged into one answer
            deltas = merge_deltas([engine.generate(r) for r in requests], n)
        # detokenize false, return_tokens_as_token_ids (services/gateway/openai/token_output.py)
        deltas = shaped(deltas, body.detokenize is False, bool(body.return_tokens_as_token_ids))
        request.state.access = record = AccessRecord(n)  # (http/access_log.py)
        reader = DeltaReader(deltas, api.prompt_field, record)
        handed_off = False
        try:
            if body.stream:
                # the first delta before the first byte: a refusal is still an HTTP status
                first = await until_disconnected(request, reader.next())
                handed_off = True
                # system_fingerprint: the model version that serves this request
                reply = dataclasses.replace(reply, fingerprint=first.version or reply.fingerprint)
                if body.continuous_usage:
                    reply = dataclasses.replace(reply, live_usage=Usage(n))
                stream = sse_stream(reader, first, reply, body.include_usage)
                return SseResponse(stream, headers=headers | SSE_HEADERS)
            choices, usage = await until_disconnected(request, collect(reader, n, reply.lp))
            if isinstance(body, CompletionRequest) and body.ranks_best_of:  # (best_of.py)
                assert reply.lp is not None
                reply.lp.n = body.n or 1
                choices = best_choices(choices, n, reply.lp.n)
            reply = dataclasses.replace(reply, fingerprint=reader.version or reply.fingerprint)
            return _json(reply.body(choices, usage, body.with_token_ids), headers=headers)
        finally:
            if not handed_off:
                await close_shielded(reader)

    async def _reply(
        self,
        request_id: str,
        body: ChatCompletionRequest | CompletionRequest,
        requests: list[GenerateRequest],
        model: str,
    ) -> Reply:
        """The response builder of a request: its ids, logprobs and echo, and the chat's
        tools, echo and reasoning split."""
        engine, n = self.engine, requests[0].sampling.n
        echo = isinstance(body, CompletionRequest) and bool(body.echo)
        api = _CHAT if isinstance(body, ChatCompletionRequest) else _COMPLETION
        lp = ChoiceLogprobs(
            api.kind,
            body.num_logprobs,
            echo_texts=[await self._prompt_text(r) for r in requests] if echo else None,
            with_prompt_logprobs=body.prompt_logprobs is not None,
            n=n,
        )
        response_id = _response_id(request_id, api.id_prefix)
        created, fingerprint = int(time.time()), engine.system_fingerprint
        fields = (response_id, model, created, fingerprint, n * len(requests), n, lp)
        if isinstance(body, ChatCompletionRequest):
            reasoning = (self.context or {}).get("reasoning_parser", "")
            return ChatReply(
                *fields, tools=body.tool_plan, chat_echo=body.echo_text, reasoning=reasoning
            )
        return CompletionReply(*fields)

    async def _beams(
        self, body: ChatCompletionRequest | CompletionRequest, requests: list[GenerateRequest]
    ) -> tuple[list[Choice], Usage]:
        """The n best beams of a beam search, as choices (no logprobs)."""
        if len(requests) > 1:
            raise RequestRejected("use_beam_search: one prompt at a time", "use_beam_search")
        n, penalty = body.n or 1, 1.0 if body.length_penalty is None else body.length_penalty
        num_prompt, beams = await beam_answers(
            self.engine, requests[0], body.beam_width, n, penalty
        )
        choices, usage = [], Usage(n)
        for i, (beam, text) in enumerate(beams):
            reason = beam_finish_reason(beam)
            choices.append(Choice(i, [text], list(beam.token_ids), reason))
            usage.add(OutputDelta(text, [], reason, num_prompt, len(beam.token_ids), True, i))
        return choices, usage

    async def _prompt_text(self, request: GenerateRequest) -> str:
        """What echo shows of a completion prompt: its text, or its token ids decoded."""
        if request.prompt is not None:
            return request.prompt
        return await self.engine.detokenize(request.prompt_token_ids or [])


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


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(obj), status, headers, media_type="application/json")


def _response_store(server: ServerConfig) -> StoresResponses | None:
    """Stored responses shared by the gateway processes of a server (a follow-up may reach
    another one), in its run directory; with one process, in its memory (None)."""
    if server.gateway_processes > 1 and server.run_dir:
        return FileResponseStore(Path(server.run_dir) / "responses")
    return None
