"""The gateway's body limits (ASGI middleware) and its OpenAPI request bodies, without a
server: the middleware is driven with hand-made ASGI messages."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from services.gateway.limits import BodyLimitMiddleware, BodyLimits, BodyStalled, BodyTooLarge
from services.gateway.openapi import json_body
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest


def _scope(headers: dict[str, str], method: str = "POST") -> dict[str, Any]:
    raw = [(k.encode(), v.encode()) for k, v in headers.items()]
    return {"type": "http", "method": method, "path": "/v1/completions", "headers": raw}


async def _run(
    scope: dict[str, Any], messages: list[dict[str, Any]], limits: BodyLimits, stall: bool = False
) -> tuple[list[dict[str, Any]], bytes | Exception]:
    """Run the middleware over an app that reads the whole body; returns what was sent and
    what the app read (or the refusal it got while reading)."""
    queue = list(messages)
    sent: list[dict[str, Any]] = []
    outcome: list[bytes | Exception] = []

    async def receive() -> dict[str, Any]:
        if queue:
            return queue.pop(0)
        if stall:  # a client that never sends the rest: only the middleware's timeout ends it
            await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        body = b""
        try:
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
            outcome.append(body)
            await receive()  # the disconnect wait after the body never times out
        except (BodyTooLarge, BodyStalled) as e:
            outcome.append(e)

    await BodyLimitMiddleware(app, limits)(scope, receive, send)
    return sent, outcome[0] if outcome else b"<app not called>"


def _body(chunks: list[bytes]) -> list[dict[str, Any]]:
    return [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]


def test_declared_oversize_is_refused_before_reading() -> None:
    scope = _scope({"content-length": str(10 * 1024 * 1024), "content-type": "application/json"})
    sent, read = asyncio.run(_run(scope, _body([b"{}"]), BodyLimits(max_bytes=4096)))
    assert sent[0]["status"] == 413 and read == b"<app not called>"
    error = orjson.loads(sent[1]["body"])["error"]
    assert "4096" in error["message"] and error["code"] == 413


def test_chunked_oversize_is_refused_while_reading() -> None:
    scope = _scope({"transfer-encoding": "chunked", "content-type": "application/json"})
    _, read = asyncio.run(_run(scope, _body([b"x" * 3000] * 3), BodyLimits(max_bytes=4096)))
    assert isinstance(read, BodyTooLarge) and read.status == 413


def test_a_stalled_body_times_out_with_408() -> None:
    scope = _scope({"content-length": "100", "content-type": "application/json"})
    messages = [{"type": "http.request", "body": b"{", "more_body": True}]
    _, read = asyncio.run(_run(scope, messages, BodyLimits(body_timeout=0.05), stall=True))
    assert isinstance(read, BodyStalled) and read.status == 408


def test_a_body_within_limits_passes_untouched() -> None:
    scope = _scope({"content-length": "6", "content-type": "application/json; charset=utf-8"})
    sent, read = asyncio.run(_run(scope, _body([b'{"a":', b"1}"]), BodyLimits(max_bytes=4096)))
    assert read == b'{"a":1}' and sent == []


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded"])
def test_a_body_that_is_not_json_gets_415(content_type: str) -> None:
    scope = _scope({"content-length": "2", "content-type": content_type})
    sent, _ = asyncio.run(_run(scope, _body([b"{}"]), BodyLimits()))
    assert sent[0]["status"] == 415
    assert content_type in orjson.loads(sent[1]["body"])["error"]["message"]


def test_openapi_bodies_are_inlined_and_precise() -> None:
    chat = json_body(ChatCompletionRequest)["requestBody"]["content"]["application/json"]
    comp = json_body(CompletionRequest)["requestBody"]["content"]["application/json"]
    assert "$ref" not in str(chat) and "$defs" not in str(chat)
    assert chat["schema"]["properties"]["messages"]["items"]["properties"]["role"]["enum"]
    kinds = [s["type"] for s in comp["schema"]["properties"]["prompt"]["anyOf"]]
    assert kinds == ["string", "array", "array"]
