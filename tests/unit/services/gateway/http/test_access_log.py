"""The access log (services/gateway/http/access_log.py) on the real HTTP app over the scripted
engine: one line per request with its id, route, status, tokens and times; one per refusal
with the reason; none with --no-access-log."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from common.config import ServerConfig
from services.gateway.http.app import create_app
from tests.fake_engine import FakeEngine
from tests.unit.services.gateway.http.test_app import CHAT, COMPLETIONS, chat_body


def _send(access_log: bool, *requests: tuple[str, str, dict[str, object]]) -> list[int]:
    async def go() -> list[int]:
        app = create_app(FakeEngine(), ServerConfig(access_log=access_log))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return [
                (await client.request(method, url, json=body or None)).status_code
                for method, url, body in requests
            ]

    return asyncio.run(go())


def _lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "shuttle.access"]


def test_one_line_per_request_with_tokens_and_times(caplog: pytest.LogCaptureFixture) -> None:
    stream = chat_body(stream=True)
    with caplog.at_level(logging.INFO, logger="shuttle.access"):
        statuses = _send(
            True,
            ("POST", CHAT, chat_body()),
            ("POST", COMPLETIONS, stream | {"prompt": "a b"}),
            ("GET", "/health", {}),
        )
    assert statuses == [200, 400, 200]
    first, refused = _lines(caplog)  # (no line for the health probe)
    access = first.__dict__["access"]
    assert first.getMessage().startswith("request chatcmpl-")
    assert " POST /v1/chat/completions 200 prompt_tokens=5 output_tokens=3 ttft=" in (
        first.getMessage()
    )
    assert access["status"] == 200 and access["ttft_s"] is not None
    assert access["time_s"] >= access["ttft_s"] >= 0
    assert first.__dict__["request_id"].startswith("chatcmpl-")
    assert refused.getMessage().startswith("refused cmpl-")
    assert "400 (messages: unknown field" in refused.getMessage()
    assert refused.__dict__["access"]["reason"].startswith("messages: unknown field")


def test_a_stream_is_logged_once_it_ends(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="shuttle.access"):
        assert _send(True, ("POST", CHAT, chat_body(stream=True))) == [200]
    (line,) = _lines(caplog)
    assert line.__dict__["access"]["output_tokens"] == 3


def test_no_access_log(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="shuttle.access"):
        assert _send(False, ("POST", CHAT, chat_body())) == [200]
    assert not _lines(caplog)


def test_a_client_gone_mid_body_is_a_499_at_info(caplog: pytest.LogCaptureFixture) -> None:
    """nginx's convention: the client closed the request. Not a 500, nothing at error, and
    /metrics counts no failure."""
    sent: list[dict[str, object]] = []

    async def go() -> bytes:
        app = create_app(FakeEngine(), ServerConfig())
        parts = [
            {"type": "http.request", "body": b'{"model": "m", "messages": [', "more_body": True},
            {"type": "http.disconnect"},
        ]

        async def receive() -> dict[str, object]:
            return parts.pop(0) if parts else {"type": "http.disconnect"}

        async def send(message: dict[str, object]) -> None:
            sent.append(message)

        headers = [(b"content-type", b"application/json"), (b"content-length", b"400")]
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": CHAT,
            "raw_path": CHAT.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": headers,
            "client": ("127.0.0.1", 1234),
            "server": ("test", 80),
        }
        await app(scope, receive, send)  # type: ignore[arg-type]
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return (await client.get("/metrics")).content

    with caplog.at_level(logging.INFO):
        metrics = asyncio.run(go())
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
    (line,) = _lines(caplog)
    assert line.levelno == logging.INFO
    assert " POST /v1/chat/completions 499 (client closed the request)" in line.getMessage()
    assert line.getMessage().startswith("closed ")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    failures = [row for row in metrics.decode().splitlines() if "request_failure_total{" in row]
    assert all(row.endswith(" 0.0") for row in failures), failures
