"""The gateway's HTTP front end: OpenAI-compatible routes over an `EngineClient`.

    POST /v1/chat/completions   POST /v1/completions   (streaming or not)
    GET  /v1/models, /v1/models/{id}   GET /health, /ping   GET /version
    POST /tokenize              POST /detokenize       (services/gateway/tokenize_routes.py)

Every error is OpenAI-shaped, `{"error": {"message", "type", "param", "code"}}`, with a 4xx
that names the field (never FastAPI's 422). A request keeps one id from the first byte to
the last: the client's `X-Request-Id` if valid, else a fresh one; the response echoes it in
that header (refusals too), and the body's `id` is it with vLLM's `chatcmpl-` / `cmpl-` prefix.

With `n` > 1 the engine interleaves the deltas of n sequences (`OutputDelta.index`); the
answer has n choices, and a stream carries one choice per chunk, as OpenAI's does: the chat
role chunks of every index first, then text and finish chunks per index as they come, then
usage (prompt counted once, outputs summed) and [DONE] once the last sequence finished. A
batch of prompts (/v1/completions) is one engine request per prompt, merged into one such
stream with choices numbered prompt-major (services/gateway/batch.py).

A request ends in the engine whenever its HTTP exchange ends: the engine's delta iterator is
closed (which aborts the request there) when a client disconnects, a stream is dropped, or a
handler fails, in a `finally` that cancellation cannot skip.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import importlib.metadata
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, Literal, TypeVar

import anyio
import orjson
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from common.config import SchedulerConfig, ServerConfig
from common.messages import FinishReason, GenerateRequest
from services.gateway import sse
from services.gateway.access_log import AccessLogMiddleware, AccessRecord, note_refusal
from services.gateway.admin import admin_router
from services.gateway.batch import merge_deltas
from services.gateway.beam_search import beam_answers
from services.gateway.beam_search import finish_reason as beam_finish_reason
from services.gateway.best_of import best_choices
from services.gateway.engine_client import EngineClient, OutputDelta, RequestFailed
from services.gateway.limits import BodyLimitMiddleware, BodyLimits
from services.gateway.logprobs import ChoiceLogprobs, TokenLogprob, merge_completion
from services.gateway.metrics import install_metrics
from services.gateway.openapi import json_body
from services.gateway.protocol import (
    REQUEST_ID_PATTERN,
    ChatCompletionRequest,
    CompletionRequest,
    RequestRejected,
    check_model,
    describe_error,
    parse_request,
)
from services.gateway.reasoning import ReasoningStream, split_reasoning
from services.gateway.token_output import shaped
from services.gateway.tokenize_routes import tokenize_router
from services.gateway.tool_stream import ToolStream
from services.gateway.tools import ToolPlan, chat_message

log = logging.getLogger("shuttle.gateway")

KEEPALIVE_S = 15.0  # an SSE comment after this long without a delta keeps proxies patient
REQUEST_ID_HEADER = "X-Request-Id"
_REQUEST_ID = REQUEST_ID_PATTERN
_CLIENT_GONE = 499  # nginx's "client closed request"; nobody reads it, logs do
_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    _CLIENT_GONE: "ClientClosedRequest",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
T = TypeVar("T")


def _package_version() -> str:
    try:
        return importlib.metadata.version("shuttle")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "0+unknown"


SERVER_VERSION = _package_version()


class ClientGone(Exception):
    """The client disconnected before its (non-streamed) answer was ready."""


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
    _install_error_handlers(app)
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
    # (imported here: the Responses routes reuse this module's stream reading and writing)
    from services.gateway.responses import responses_router

    app.include_router(responses_router(engine, context), dependencies=auth)
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/ping", routes.health, methods=["GET", "POST"])  # vLLM's alias
    app.add_api_route("/version", routes.version, methods=["GET"])
    app.include_router(admin_router(engine, admin_token, server.model_root or None))
    # GET /metrics, and the engine's request timers
    install_metrics(app, engine, server.metrics_vllm_names)
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
        """One card per name the served model answers to (none while starting)."""
        cards = [self._card(name) for name in self.engine.model_names]
        return _json({"object": "list", "data": cards})

    async def model(self, model_id: str) -> Response:
        """GET /v1/models/{id}: the card of a name the model answers to, else a 404."""
        if model_id not in self.engine.model_names:
            raise RequestRejected(f"model: the model `{model_id}` does not exist", "model", 404)
        return _json(self._card(model_id))

    def _card(self, name: str) -> dict[str, Any]:
        engine = self.engine
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "shuttle",
            "root": engine.model_name,
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
        request_id = _request_id(request, api.id_prefix)
        body = parse_request(api.body, await request.body(), self.context)
        engine = self.engine
        check_model(body.model, engine.model_names, engine.is_ready(), engine.draining)
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
        reply = _Reply(
            api.kind,
            _response_id(request_id, api.id_prefix),
            engine.model_name,
            int(time.time()),
            engine.system_fingerprint,
            n * len(requests),
            n,
            lp,
            body.tool_plan if isinstance(body, ChatCompletionRequest) else None,
            chat_echo=body.echo_text if isinstance(body, ChatCompletionRequest) else "",
            reasoning=(self.context or {}).get("reasoning_parser", "")
            if api.kind == "chat"
            else "",
        )
        if body.use_beam_search:  # (services/gateway/beam_search.py)
            work = self._beams(body, requests, reply.lp)
            choices, usage = await until_disconnected(request, work)
            headers = {REQUEST_ID_HEADER: request_id}
            return _json(reply.body(choices, usage, body.with_token_ids), headers=headers)
        if len(requests) == 1:
            deltas = engine.generate(requests[0])
        else:  # a batch of prompts: one engine request each, merged into one answer
            deltas = merge_deltas([engine.generate(r) for r in requests], n)
        # detokenize false, return_tokens_as_token_ids (services/gateway/token_output.py)
        deltas = shaped(deltas, body.detokenize is False, bool(body.return_tokens_as_token_ids))
        request.state.access = record = AccessRecord(n)
        reader = DeltaReader(deltas, api.prompt_field, record)
        headers = {REQUEST_ID_HEADER: request_id}
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
                return SseResponse(stream, headers=headers | _SSE_HEADERS)
            choices, usage = await until_disconnected(request, collect(reader, n, lp))
            if isinstance(body, CompletionRequest) and body.ranks_best_of:  # (best_of.py)
                lp.n = body.n or 1
                choices = best_choices(choices, n, lp.n)
            reply = dataclasses.replace(reply, fingerprint=reader.version or reply.fingerprint)
            return _json(reply.body(choices, usage, body.with_token_ids), headers=headers)
        finally:
            if not handed_off:
                await close_shielded(reader)

    async def _beams(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        requests: list[GenerateRequest],
        lp: ChoiceLogprobs | None,
    ) -> tuple[list[Choice], Usage]:
        """The n best beams of a beam search, as choices (no logprobs)."""
        if len(requests) > 1:
            raise RequestRejected("use_beam_search: one prompt at a time", "use_beam_search")
        n, penalty = body.n or 1, 1.0 if body.length_penalty is None else body.length_penalty
        num_prompt, beams = await beam_answers(
            self.engine, requests[0], body.beam_width, n, penalty
        )
        if lp is not None:
            lp.num_logprobs = None  # (the beams' logprobs are not reported)
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


# --- reading the engine ---------------------------------------------------------------------


class DeltaReader:
    """Reads one request's deltas, each in a task of its own, so that a wait can time out
    (keep-alive) or lose a race with a disconnect without cancelling the engine mid-read."""

    def __init__(
        self,
        deltas: AsyncGenerator[OutputDelta, None],
        prompt_field: str = "prompt",
        record: AccessRecord | None = None,
    ) -> None:
        self._deltas = deltas
        self._prompt_field = prompt_field  # what the endpoint calls the prompt, for refusals
        self._record = record  # the access log's (services/gateway/access_log.py)
        self._pending: asyncio.Task[OutputDelta | None] | None = None
        self.version = ""  # the model version named by the deltas read so far

    async def next(self, timeout: float | None = None) -> OutputDelta:
        """The next delta. Raises TimeoutError if none came within `timeout` (the read goes
        on, the next call picks it up) and RequestFailed if the engine failed the request."""
        if self._pending is None:
            self._pending = asyncio.create_task(_next_or_none(self._deltas))
        done, _ = await asyncio.wait({self._pending}, timeout=timeout)
        if not done:
            raise TimeoutError
        task, self._pending = self._pending, None
        try:
            delta = task.result()
        except RequestFailed as e:
            raise e.naming_prompt(self._prompt_field) from None
        if delta is None:
            raise RequestFailed(500, "the engine ended the stream without a finish reason")
        self.version = delta.version or self.version
        if self._record is not None:
            self._record.see(delta)
        return delta

    async def aclose(self) -> None:
        """Stop reading and close the engine's iterator, which aborts the request there."""
        task, self._pending = self._pending, None
        if task is not None:
            task.cancel()
            await asyncio.wait({task})
            if not task.cancelled():
                task.exception()  # retrieved, so asyncio does not log it as lost
        await self._deltas.aclose()


async def _next_or_none(deltas: AsyncIterator[OutputDelta]) -> OutputDelta | None:
    return await anext(deltas, None)


async def close_shielded(reader: DeltaReader) -> None:
    # this often runs while the request is being cancelled; the engine must still hear of it
    with anyio.CancelScope(shield=True):
        await reader.aclose()


@dataclasses.dataclass(slots=True)
class Choice:
    """One sequence's whole output, gathered from its deltas."""

    index: int
    parts: list[str] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: FinishReason = FinishReason.NONE
    stop_reason: str | int | None = None  # vLLM's: the stop string or token id that ended it
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)  # when asked

    @property
    def text(self) -> str:
        return "".join(self.parts)


class Usage:
    """A request's token counts: each prompt once (its `n` sequences share it), summed over
    a batch of prompts; outputs summed over every sequence."""

    def __init__(self, n: int = 1) -> None:
        self.n = n  # choices per prompt: choice index // n is the prompt's
        self._num_prompt_tokens: dict[int, int] = {}  # prompt index -> its count
        self._num_output_tokens: dict[int, int] = {}  # index -> that sequence's count so far

    def add_prompt(self, delta: OutputDelta) -> None:
        """Count the delta's prompt only (a stream's role chunks come before its tokens)."""
        self._num_prompt_tokens[delta.index // self.n] = delta.num_prompt_tokens

    def add(self, delta: OutputDelta) -> None:
        self._num_prompt_tokens[delta.index // self.n] = delta.num_prompt_tokens
        self._num_output_tokens[delta.index] = delta.num_output_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return sum(self._num_prompt_tokens.values())

    @property
    def num_output_tokens(self) -> int:
        return sum(self._num_output_tokens.values())

    def as_dict(self) -> dict[str, int]:
        prompt, output = self.num_prompt_tokens, self.num_output_tokens
        return {
            "prompt_tokens": prompt,
            "completion_tokens": output,
            "total_tokens": prompt + output,
        }


async def collect(
    reader: DeltaReader, n: int = 1, lp: ChoiceLogprobs | None = None
) -> tuple[list[Choice], Usage]:
    """Every sequence's text, token ids, logprobs and finish reason (by index), and the
    usage (`n` choices per prompt); prompt logprobs go to `lp`."""
    choices: dict[int, Choice] = {}
    usage = Usage(n)
    while True:
        delta = await reader.next()
        usage.add(delta)
        choice = choices.setdefault(delta.index, Choice(delta.index))
        choice.parts.append(delta.text)
        choice.token_ids.extend(delta.token_ids)
        choice.logprobs.extend(delta.logprobs)
        if lp is not None:
            lp.see_prompt(delta.index, delta.prompt_logprobs)
        if delta.finish_reason != FinishReason.NONE:
            choice.finish_reason = delta.finish_reason
            choice.stop_reason = delta.stop_reason
        if delta.last:
            return sorted(choices.values(), key=lambda c: c.index), usage


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise ClientGone."""
    task = asyncio.ensure_future(work)
    gone = asyncio.create_task(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        task.cancel()  # no-ops on finished tasks
        gone.cancel()
        await asyncio.wait({task, gone})
    if task.cancelled():
        raise ClientGone
    return task.result()


async def _wait_disconnect(receive: Receive) -> None:
    # the body has been read, so the next ASGI message is the disconnect (when it comes)
    while (await receive())["type"] != "http.disconnect":
        pass


# --- writing the answer ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class _Reply:
    """What every chunk or body of one response repeats, and how to build them."""

    kind: Literal["chat", "completion"]
    request_id: str
    model: str
    created: int
    fingerprint: str
    n: int = 1  # choices (sequences) in the answer
    n_per_prompt: int = 1  # of them, per prompt of a batch (the request's `n`)
    lp: ChoiceLogprobs | None = None  # logprobs and echo, when asked
    tools: ToolPlan | None = None  # chat with tools: tool calls are read from the output
    live_usage: Usage | None = None  # continuous_usage_stats: the usage so far, every chunk
    chat_echo: str = ""  # chat `echo`: what every choice's content starts with
    reasoning: str = ""  # chat with --reasoning-parser: its name (services/gateway/reasoning.py)

    def head(self) -> list[bytes]:
        """The chat stream's role chunks, one per choice, before any text."""
        if self.kind == "chat":
            role = {"role": "assistant", "content": ""}
            events = [self._event(role, "", None, index) for index in range(self.n)]
            if self.chat_echo:
                events += [self.text(self.chat_echo, index) for index in range(self.n)]
            return events
        return []

    def text(
        self,
        text: str,
        index: int = 0,
        logprobs: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> bytes:
        return self._event({"content": text}, text, None, index, logprobs, extra)

    def delta(self, delta: OutputDelta, first: bool) -> list[bytes]:
        """A delta's chunks before its finish: with echo, the choice's prompt first (`first`
        delta of the choice); its text, with its tokens' logprobs when asked; the prompt's
        logprobs (prompt_logprobs) with the first chunk that can carry them."""
        lp, i = self.lp, delta.index
        if lp is None:
            return [self.text(delta.text, i)] if delta.text else []
        out = []
        lp.see_prompt(i, delta.prompt_logprobs)
        extra = lp.stream_extra(i)
        if first and lp.echo_texts is not None:
            out.append(self.text(lp.echo_text(i), i, lp.echo(i), extra))
            extra = {}
        if lp.is_on and delta.logprobs:
            return [*out, self.text(delta.text, i, lp.tokens(i, delta.logprobs), extra)]
        if delta.text or extra:
            out.append(self.text(delta.text, i, None, extra))
        return out

    def reasoning_event(self, text: str, index: int) -> bytes:
        """A chat stream's reasoning delta (--reasoning-parser)."""
        return self._event({"reasoning_content": text}, "", None, index)

    def finish(
        self,
        reason: FinishReason,
        index: int = 0,
        called: bool = False,
        stop_reason: str | int | None = None,
    ) -> bytes:
        finish = "tool_calls" if called and reason == FinishReason.STOP else reason.openai
        return self._event({}, "", finish, index, stop_reason=stop_reason)

    def call_events(self, deltas: list[dict[str, Any]], index: int) -> list[bytes]:
        """A streamed choice's tool_calls deltas (services/gateway/tool_stream.py)."""
        return [self._event(d, "", None, index) for d in deltas]

    def tool_events(self, stream: ToolStream, index: int) -> tuple[list[bytes], bool]:
        """A streamed choice's held-back text at its finish: content, then the calls' rest."""
        piece, _ = stream.finish()
        events = [self.text(piece.content, index)] if piece.content else []
        return events + self.call_events(piece.deltas, index), stream.called

    def usage(self, usage: Usage) -> bytes:
        counts = (usage.num_prompt_tokens, usage.num_output_tokens)
        ids = (self.request_id, self.model, self.created)
        return sse.sse_event(sse.usage_chunk(self.kind, *ids, *counts, self.fingerprint))

    def _event(
        self,
        delta: dict[str, Any],
        text: str,
        finish: str | None,
        index: int,
        logprobs: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
        stop_reason: str | int | None = None,
    ) -> bytes:
        ids = (self.request_id, self.model, self.created)
        fp = self.fingerprint
        if self.kind == "chat":
            chunk = sse.chat_chunk(*ids, delta, finish, fp, index, logprobs, extra)
        else:
            chunk = sse.completion_chunk(*ids, text, finish, fp, index, logprobs, extra)
        if stop_reason is not None:  # vLLM's, beside the finish_reason (null: left out)
            chunk["choices"][0]["stop_reason"] = stop_reason
        if self.live_usage is not None:
            chunk["usage"] = self.live_usage.as_dict()
        return sse.sse_event(chunk)

    def _choice(self, choice: Choice, with_token_ids: bool) -> dict[str, Any]:
        out: dict[str, Any] = {"index": choice.index}
        lp, i = self.lp, choice.index
        if lp is not None and lp.echo_texts is not None:  # (echo's text offsets come first)
            echoed = lp.echo(i)
            logprobs = merge_completion(echoed, lp.tokens(i, choice.logprobs))
        else:
            logprobs = lp.tokens(i, choice.logprobs) if lp is not None else None
        finish = choice.finish_reason.openai
        if self.kind == "chat":
            thought, text = (
                split_reasoning(choice.text, self.reasoning)
                if self.reasoning
                else (None, choice.text)
            )
            out["message"], finish = chat_message(text, finish, self.tools)
            if thought is not None:
                out["message"]["reasoning_content"] = thought
            if self.chat_echo:
                out["message"]["content"] = self.chat_echo + (out["message"]["content"] or "")
        else:
            out["text"] = (lp.echo_text(i) if lp is not None else "") + choice.text
        out |= {"logprobs": logprobs, "finish_reason": finish}
        if choice.stop_reason is not None:  # vLLM's (null there otherwise; left out here)
            out["stop_reason"] = choice.stop_reason
        if lp is not None and self.kind == "completion":
            out |= lp.extra(i)
        if with_token_ids:
            out["token_ids"] = choice.token_ids
        return out

    def body(self, choices: list[Choice], usage: Usage, with_token_ids: bool) -> dict[str, Any]:
        """The non-streamed answer (with the output token ids when asked for)."""
        prompt, output = usage.num_prompt_tokens, usage.num_output_tokens
        out = {
            "id": self.request_id,
            "object": "chat.completion" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": [self._choice(c, with_token_ids) for c in choices],
            "usage": dict(
                prompt_tokens=prompt, completion_tokens=output, total_tokens=prompt + output
            ),
        }
        if self.lp is not None and self.kind == "chat":  # vLLM: the response's, for chat
            out |= self.lp.extra(0)
        return out


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def sse_stream(
    reader: DeltaReader, first: OutputDelta, reply: _Reply, include_usage: bool
) -> AsyncGenerator[bytes, None]:
    """The SSE body: [role chunks], text and finish chunks per choice, [usage chunk], [DONE].
    A failure after the first byte becomes an error event, still followed by [DONE]."""
    try:
        usage = reply.live_usage or Usage(reply.n_per_prompt)
        usage.add_prompt(first)  # (continuous usage: the role chunks show the prompt's)
        for event in reply.head():
            yield event
        delta = first
        seen: set[int] = set()  # choices that had a delta
        tools: dict[int, ToolStream] = {}  # with tools: each choice's calls held back
        thinking: dict[int, ReasoningStream] = {}  # --reasoning-parser: each choice's split
        while True:
            usage.add(delta)
            if reply.reasoning:
                split = thinking.setdefault(delta.index, ReasoningStream(reply.reasoning))
                thought, text = split.feed(delta.text, delta.finish_reason != FinishReason.NONE)
                if thought:
                    yield reply.reasoning_event(thought, delta.index)
                delta = dataclasses.replace(delta, text=text)
            stream, calls = None, []
            if reply.tools is not None:
                stream = tools.setdefault(delta.index, ToolStream(reply.tools))
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
                yield reply.finish(delta.finish_reason, delta.index, called, delta.stop_reason)
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
        yield sse.sse_event(sse.error_chunk(e.message, _error_type(e.status), e.status, e.param))
    except Exception:
        log.exception("stream %s failed", reply.request_id)
        yield sse.sse_event(sse.error_chunk("internal error", _error_type(500), 500))
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


# --- errors ---------------------------------------------------------------------------------


def _error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")


def error_response(
    request: Request, status: int, message: str, param: str | None = None
) -> Response:
    """An OpenAI-shaped error, echoing the request id when it is known."""
    body = {"message": message, "type": _error_type(status), "param": param, "code": status}
    note_refusal(request.state, message)
    headers = {}
    if (request_id := _known_request_id(request)) is not None:
        headers[REQUEST_ID_HEADER] = request_id
    if status in (429, 503):
        headers["Retry-After"] = "1"
    return _json({"error": body}, status, headers)


def _known_request_id(request: Request) -> str | None:
    """The request's id once a route chose it; before that (a refusal by the API key check,
    say) the client's own `X-Request-Id` when it is a valid one."""
    request_id = getattr(request.state, "request_id", None)
    if request_id is None:
        request_id = request.headers.get(REQUEST_ID_HEADER)
        if request_id is not None and not _REQUEST_ID.fullmatch(request_id):
            return None
    return request_id


def _install_error_handlers(app: FastAPI) -> None:
    async def rejected(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestRejected | RequestFailed)
        return error_response(request, exc.status, exc.message, exc.param)

    async def invalid(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        error = dict(exc.errors()[0])
        error["loc"] = tuple(error.get("loc", ()))[1:]  # drop "body" / "header" / "query"
        message, param = describe_error(error)
        return error_response(request, 400, message, param)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return error_response(request, exc.status_code, str(exc.detail))

    async def client_gone(request: Request, exc: Exception) -> Response:
        return error_response(request, _CLIENT_GONE, "client closed the request")

    async def internal(request: Request, exc: Exception) -> Response:
        return error_response(request, 500, "internal error")

    app.add_exception_handler(RequestRejected, rejected)
    app.add_exception_handler(RequestFailed, rejected)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(ClientGone, client_gone)
    app.add_exception_handler(Exception, internal)


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(obj), status, headers, media_type="application/json")
