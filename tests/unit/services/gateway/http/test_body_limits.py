"""The gateway's body limits (ASGI middleware) and its OpenAPI request bodies, without a
server: the middleware is driven with hand-made ASGI messages."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
import uvicorn

from common.config import ServerConfig
from services.gateway.http.app import create_app
from services.gateway.http.body_limits import (
    BodyLimitMiddleware,
    BodyLimits,
    BodyStalled,
    BodyTooLarge,
    drain_body,
)
from services.gateway.http.openapi import json_body
from services.gateway.openai.chat_protocol import ChatCompletionRequest
from services.gateway.openai.completions_protocol import CompletionRequest
from tests.fake_engine import FakeEngine
from tests.waiting import wait_until


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


def test_declared_oversize_is_drained_unless_the_client_awaits_100_continue() -> None:
    async def go(headers: dict[str, str]) -> int:
        messages = _body([b"x" * 3000] * 4)

        async def receive() -> dict[str, Any]:
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            pass

        app = BodyLimitMiddleware(lambda *_: asyncio.sleep(0), BodyLimits(max_bytes=4096))
        await app(_scope(headers), receive, send)
        return len(messages)  # left unread

    declared = {"content-length": "12000", "content-type": "application/json"}
    assert asyncio.run(go(declared)) == 0  # read to its end: the client can read the 413
    assert asyncio.run(go(declared | {"expect": "100-continue"})) == 4  # it sent nothing yet


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


def test_draining_a_refused_body_is_bounded_in_bytes_and_time() -> None:
    async def endless() -> dict[str, Any]:  # a client that never stops sending
        await asyncio.sleep(0)
        return {"type": "http.request", "body": b"x" * 1000, "more_body": True}

    async def stalled() -> dict[str, Any]:  # one that stops sending mid-body
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    assert not asyncio.run(drain_body(endless, max_bytes=10_000, timeout=60))
    assert not asyncio.run(drain_body(stalled, timeout=0.05))
    ends = iter(_body([b"a", b"b", b"c"]))
    assert asyncio.run(drain_body(lambda: _next_message(ends)))


async def _next_message(messages: Iterator[dict[str, Any]]) -> dict[str, Any]:
    return next(messages)


def test_openapi_bodies_are_inlined_and_precise() -> None:
    chat = json_body(ChatCompletionRequest)["requestBody"]["content"]["application/json"]
    comp = json_body(CompletionRequest)["requestBody"]["content"]["application/json"]
    assert "$ref" not in str(chat) and "$defs" not in str(chat)
    assert chat["schema"]["properties"]["messages"]["items"]["properties"]["role"]["enum"]
    kinds = [s["type"] for s in comp["schema"]["properties"]["prompt"]["anyOf"]]
    assert kinds == ["string", "array", "array", "array"]


# --- a real server and a real client ----------------------------------------------------------


@contextlib.contextmanager
def _serving(app: Any) -> Iterator[str]:
    """`app` on uvicorn (as the gateway runs it) on a free loopback port, in a thread."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, 30, "uvicorn started")
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def _post_raw(url: str, head: bytes, body: bytes) -> bytes:
    """Send a whole request before reading anything (as plain HTTP/1.1 clients do); the
    answer read until the server closes. OSError if the server reset the connection."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(head + body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        return answer


BIG = 10 * 1024 * 1024


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_a_client_sending_10_mb_can_send_it_all_then_read_the_413(declared: bool) -> None:
    """The refusal is ready while the client is still sending: the server reads (and drops)
    the rest of the body first, so the client's writes succeed and it reads the 413 instead
    of a connection reset."""
    app = create_app(FakeEngine(), ServerConfig(max_request_bytes=1024 * 1024))
    head = b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
    head += b"X-Request-Id: big-1\r\n"
    if declared:
        head += b"Content-Length: %d\r\n\r\n" % BIG
        body = b" " * BIG
    else:
        chunk = b" " * 65536
        head += b"Transfer-Encoding: chunked\r\n\r\n"
        body = b"10000\r\n" + chunk + b"\r\n"
        body = body * (BIG // len(chunk)) + b"0\r\n\r\n"
    with _serving(app) as url:
        answer = _post_raw(url, head, body)
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line.split()[1] == b"413", answer[:300]
    assert b"x-request-id: big-1" in rest.lower()
    assert b"--max-request-bytes" in rest


def test_the_openai_clients_http_library_reads_the_413() -> None:
    app = create_app(FakeEngine(), ServerConfig(max_request_bytes=1024 * 1024))
    content = orjson.dumps({"prompt": "x" * BIG})
    with _serving(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        headers = {"content-type": "application/json", "x-request-id": "big-2"}
        resp = client.post("/v1/completions", content=content, headers=headers)
    assert resp.status_code == 413, resp.text
    assert "--max-request-bytes" in resp.json()["error"]["message"]
    assert resp.headers["x-request-id"] == "big-2"
