"""The SSE body of a streamed answer and the response that carries it
(services/gateway/http/streaming.py), through the app and a fake engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from common.messages import FinishReason
from services.gateway.http import streaming
from services.gateway.http.streaming import SseResponse
from tests.fake_engine import FakeEngine, delta
from tests.sse_events import parse_sse
from tests.unit.services.gateway.http.test_app import CHAT, COMPLETIONS, _scope, run

STOP = FinishReason.STOP


def test_keepalive_comment_while_engine_is_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streaming, "KEEPALIVE_S", 0.01)
    engine = FakeEngine([delta("a"), 0.3, delta("b", STOP, 2)])
    resp = run(engine, "POST", COMPLETIONS, json={"prompt": "x", "stream": True})
    assert b"\n: keep-alive\n\n" in resp.content
    events = parse_sse(resp.content)
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["a", "b", ""]


def test_sse_response_closes_its_body_when_send_fails() -> None:
    # ASGI 2.4 servers raise from send() when the client is gone; the body must be closed then
    # and there, not whenever the garbage collector gets to it
    closed = []

    async def body() -> AsyncGenerator[bytes, None]:
        try:
            yield b"data: 1\n\n"
            yield b"data: 2\n\n"
        finally:
            closed.append(True)

    async def go() -> list[bool]:
        response = SseResponse(body())

        async def send(message: dict[str, Any]) -> None:
            if message.get("body"):
                raise OSError("connection reset by peer")

        await response(_scope(CHAT, "2.4"), asyncio.Event().wait, send)
        return list(closed)  # `response` still holds the generator here

    assert asyncio.run(go()) == [True]
