"""The SSE body of a streamed chat or completions answer, and the response that carries
it: role chunks, text, reasoning and tool-call chunks per choice as the engine's deltas
come, finish chunks, [usage], [DONE]; a keep-alive comment while the engine is quiet. The
Responses stream (services/gateway/http/responses_stream.py) shares the keep-alive and the
response class."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncGenerator
from typing import Any

import anyio
from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from common.messages import FinishReason
from services.gateway.engine.client import OutputDelta, RequestFailed
from services.gateway.http import sse
from services.gateway.http.deltas import DeltaReader, Usage, close_shielded
from services.gateway.http.errors import REQUEST_ID_HEADER, error_type
from services.gateway.http.reply import Reply
from services.gateway.openai.reasoning import ReasoningStream
from services.gateway.openai.tool_stream import ToolStream

log = logging.getLogger("shuttle.gateway")

KEEPALIVE_S = 15.0  # an SSE comment after this long without a delta keeps proxies patient

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def sse_stream(
    reader: DeltaReader, first: OutputDelta, reply: Reply, include_usage: bool
) -> AsyncGenerator[bytes, None]:
    """The SSE body: [role chunks], text and finish chunks per choice, [usage chunk], [DONE].
    A failure after the first byte becomes an error event, still followed by [DONE]."""
    try:
        usage = reply.live_usage or Usage(reply.n_per_prompt)
        usage.add_prompt(first)  # (continuous usage: the role chunks show the prompt's)
        for event in reply.head():
            yield event
        choices = _StreamedChoices(reply)
        delta = first
        while True:
            usage.add(delta)
            for event in choices.events(delta):
                yield event
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


class _StreamedChoices:
    """Each streamed choice's state: whether it had a delta yet, its reasoning splitter
    (--reasoning-parser) and its tool-call reader (with tools: calls are held back)."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.seen: set[int] = set()
        self.thinking: dict[int, ReasoningStream | None] = {}
        self.tools: dict[int, ToolStream | None] = {}

    def events(self, delta: OutputDelta) -> list[bytes]:
        """A delta's chunks: reasoning, text, tool-call deltas, and the finish when it ends."""
        reply, i = self.reply, delta.index
        finished = delta.finish_reason != FinishReason.NONE
        if i not in self.tools:
            self.thinking[i], self.tools[i] = reply.reasoning_stream(), reply.tool_stream()
        out: list[bytes] = []
        if (split := self.thinking[i]) is not None:
            thought, text = split.feed(delta.text, finished)
            if thought:
                out.append(reply.reasoning_event(thought, i))
            delta = dataclasses.replace(delta, text=text)
        calls: list[dict[str, Any]] = []
        if (stream := self.tools[i]) is not None:
            piece = stream.feed(delta.text)
            delta, calls = dataclasses.replace(delta, text=piece.content), piece.deltas
        out += reply.delta(delta, first=i not in self.seen)
        out += reply.call_events(calls, i)
        self.seen.add(i)
        if finished:
            called = False
            if stream is not None:
                events, called = reply.tool_events(stream, i)
                out += events
            out.append(reply.finish(delta.finish_reason, i, called, delta.stop_reason))
        return out


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
