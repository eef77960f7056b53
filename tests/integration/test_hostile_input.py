"""Hostile and malformed requests: each gets a 4xx that names the problem, none a 5xx; a client
that stalls mid-request blocks nobody; afterwards the server still serves and holds no KV
block and no running request."""

from __future__ import annotations

import dataclasses
import json
import select
import socket
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest

from tests.server import Server, running_server
from tests.waiting import wait_until

ADMIN = "hostile-admin"
MAX_PROMPT_CHARS = 20_000
BODY_TIMEOUT_S = 2
MIB = 1024 * 1024
MSG = [{"role": "user", "content": "hi"}]
CHAT, COMP = "/v1/chat/completions", "/v1/completions"


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: Any  # bytes are sent as they are; anything else as JSON
    status: int
    words: tuple[str, ...]  # each must appear in the error message
    headers: dict[str, str] = dataclasses.field(default_factory=dict)


def _chat(**fields: Any) -> dict[str, Any]:
    return {"messages": MSG, "max_tokens": 4, **fields}


def _raw_chat(fragment: str) -> bytes:
    return ('{"messages": [{"role": "user", "content": "hi"}], ' + fragment + "}").encode()


def _nested(depth: int) -> bytes:
    return b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"


CASES = [
    # wrong types
    Case("max_tokens a string", CHAT, _chat(max_tokens="5"), 400, ("max_tokens", "integer")),
    Case("max_tokens a bool", CHAT, _chat(max_tokens=True), 400, ("max_tokens", "integer")),
    Case("max_tokens a float", COMP, {"prompt": "a", "max_tokens": 2.5}, 400, ("max_tokens",)),
    Case("stream a string", CHAT, _chat(stream="yes"), 400, ("stream", "boolean")),
    Case("messages an object", CHAT, {"messages": {"role": "user"}}, 400, ("messages", "list")),
    Case(
        "role unknown",
        CHAT,
        {"messages": [{"role": "root", "content": "x"}]},
        400,
        ("messages[0].role",),
    ),
    Case(
        "content null",
        CHAT,
        {"messages": [{"role": "user", "content": None}]},
        400,
        ("messages[0].content",),
    ),
    Case(
        "content an image part",
        CHAT,
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
                }
            ]
        },
        400,
        ("content", "text parts"),
    ),
    Case("stop a number", CHAT, _chat(stop=7), 400, ("stop",)),
    Case(
        "stream_options a list",
        CHAT,
        _chat(stream=True, stream_options=[1]),
        400,
        ("stream_options",),
    ),
    Case("prompt an object", COMP, {"prompt": {"text": "a"}}, 400, ("prompt",)),
    Case("prompt nested lists", COMP, {"prompt": [[[1]]]}, 400, ("prompt",)),
    # huge numbers
    Case("max_tokens 1e309", CHAT, _raw_chat('"max_tokens": 1e309'), 400, ("max_tokens",)),
    Case("max_tokens 2**70", CHAT, _chat(max_tokens=2**70), 400, ("max_tokens", "<=")),
    Case("seed 2**64", CHAT, _chat(seed=2**64), 400, ("seed",)),
    Case("priority -2**70", CHAT, _chat(priority=-(2**70)), 400, ("priority",)),
    Case("timeout 1e309", CHAT, _raw_chat('"timeout": 1e309'), 400, ("timeout",)),
    Case("token id 2**40", COMP, {"prompt": [1, 2**40]}, 400, ("prompt", "token")),
    Case("n 1000", CHAT, _chat(n=1000), 400, ("n", "<=")),
    # negative and NaN values
    Case("max_tokens negative", COMP, {"prompt": "a", "max_tokens": -1}, 400, ("max_tokens",)),
    Case("temperature NaN", CHAT, _raw_chat('"temperature": NaN'), 400, ("temperature",)),
    Case(
        "temperature -Infinity", CHAT, _raw_chat('"temperature": -Infinity'), 400, ("temperature",)
    ),
    Case("top_p negative", CHAT, _chat(top_p=-0.5), 400, ("top_p",)),
    Case("top_k negative", CHAT, _chat(top_k=-7), 400, ("top_k",)),
    Case("token id negative", COMP, {"prompt": [5, -1]}, 400, ("prompt", "token")),
    Case("timeout negative", CHAT, _chat(timeout=-3), 400, ("timeout",)),
    # empty and oversized
    Case("empty prompt", COMP, {"prompt": ""}, 400, ("prompt", "empty")),
    Case("empty token list", COMP, {"prompt": []}, 400, ("prompt", "empty")),
    Case("no messages", CHAT, {"messages": []}, 400, ("messages",)),
    Case("empty body", CHAT, b"", 400, ("body", "JSON")),
    Case("body null", CHAT, b"null", 400, ("body", "object")),
    Case("body a list", CHAT, b"[1, 2]", 400, ("body", "object")),
    Case(
        "10,000 stop strings",
        CHAT,
        _chat(stop=[f"s{i}" for i in range(10_000)]),
        400,
        ("stop", "64"),
    ),
    Case("an empty stop string", CHAT, _chat(stop=[""]), 400, ("stop",)),
    Case(
        "10,000 stop token ids",
        CHAT,
        _chat(stop_token_ids=list(range(10_000))),
        400,
        ("stop_token_ids",),
    ),
    Case(
        "prompt over --max-prompt-chars",
        COMP,
        {"prompt": "word " * 5_000},
        413,
        ("prompt", str(MAX_PROMPT_CHARS)),
    ),
    Case(
        "chat over --max-prompt-chars",
        CHAT,
        {
            "messages": [
                {"role": "user", "content": "x" * 15_000},
                {"role": "user", "content": "y" * 6_000},
            ]
        },
        413,
        ("messages", str(MAX_PROMPT_CHARS)),
    ),
    Case("10 MB body", CHAT, _chat(user="u" * (10 * MIB)), 413, ("body", str(4 * MIB))),
    # malformed bytes
    Case(
        "invalid UTF-8",
        CHAT,
        b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}',
        400,
        ("body", "JSON"),
    ),
    Case(
        "lone surrogate escape",
        CHAT,
        b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
        400,
        ("JSON",),
    ),
    Case("deeply nested JSON", CHAT, _nested(100_000), 400, ("body", "JSON")),
    Case("truncated JSON", CHAT, b'{"messages": [{"role": "us', 400, ("body", "JSON")),
    Case("NUL bytes", CHAT, b'{"messages"\x00: []}', 400, ("body", "JSON")),
    # wrong headers
    Case(
        "text/plain body",
        CHAT,
        _chat(),
        415,
        ("Content-Type", "text/plain"),
        {"content-type": "text/plain"},
    ),
    Case(
        "form body",
        COMP,
        b"prompt=hi",
        415,
        ("Content-Type",),
        {"content-type": "application/x-www-form-urlencoded"},
    ),
    Case(
        "bad request id",
        CHAT,
        _chat(),
        400,
        ("X-Request-Id",),
        {"x-request-id": "<script>alert(1)</script>"},
    ),
    # framing errors are refused by uvicorn's HTTP parser, in plain text, before the app
    Case(
        "bad Content-Length",
        CHAT,
        _chat(),
        400,
        ("Invalid HTTP request",),
        {"content-length": "lots"},
    ),
    Case("unknown model", CHAT, _chat(model="../../etc/passwd"), 404, ("model",)),
]

# Unknown fields are ignored, as vLLM does (OpenAI clients send extras): served, not refused.
# unknown fields are refused by name (issue 24; --ignore-unknown-fields tolerates them)
UNKNOWN = [
    ("unknown top-level field", _chat(frobnicate={"deep": [1, 2, 3]}), "frobnicate"),
    ("unknown nested field", _chat(stream_options=None, __proto__={"admin": True}), "__proto__"),
    (
        "unknown message field",
        {"messages": [{"role": "user", "content": "hi", "x": 1}], "max_tokens": 2},
        "messages[0].x",
    ),
]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with running_server(
        "--admin-token",
        ADMIN,
        "--max-model-len",
        "512",
        "--max-prompt-chars",
        str(MAX_PROMPT_CHARS),
        "--request-body-timeout",
        str(BODY_TIMEOUT_S),
    ) as s:
        yield s


def _send(server: Server, case: Case) -> httpx.Response:
    body = case.body if isinstance(case.body, bytes) else json.dumps(case.body).encode()
    headers = {"content-type": "application/json"} | case.headers
    if "content-length" in case.headers or len(body) > 4 * MIB:
        return _raw_post(server, case.path, body, headers)
    return httpx.post(server.url + case.path, content=body, headers=headers, timeout=60)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hostile_request_gets_a_4xx_naming_the_problem(server: Server, case: Case) -> None:
    r = _send(server, case)
    assert r.status_code == case.status, (case.name, r.status_code, r.text[:500])
    is_json = r.headers.get("content-type", "").startswith("application/json")
    error = r.json()["error"] if is_json else {"message": r.text, "code": r.status_code}
    for word in case.words:
        assert word in error["message"], (case.name, error)
    assert error["code"] == case.status


@pytest.mark.parametrize("name,body,param", UNKNOWN, ids=[t[0] for t in UNKNOWN])
def test_unknown_fields_are_refused_by_name(
    server: Server, name: str, body: Any, param: str
) -> None:
    r = httpx.post(server.url + CHAT, json=body, timeout=120)
    assert r.status_code == 400, (name, r.text[:300])
    assert r.json()["error"]["param"] == param


def test_chunked_body_over_the_limit_is_413(server: Server) -> None:
    chunk = b" " * (256 * 1024)
    body = b'{"messages": [], "user": "' + chunk * 17 + b'"}'  # > 4 MiB, no Content-Length
    r = _raw_post(server, CHAT, body, {"content-type": "application/json"}, chunked=True)
    assert r.status_code == 413 and str(4 * MIB) in r.json()["error"]["message"]


def test_a_stalled_client_blocks_nobody_and_gets_408(server: Server) -> None:
    host, port = _host_port(server)
    stalled_body = socket.create_connection((host, port), timeout=60)
    stalled_head = socket.create_connection((host, port), timeout=60)
    try:
        stalled_body.sendall(
            f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/"
            'json\r\nContent-Length: 100\r\n\r\n{"messages"'.encode()
        )
        stalled_head.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Le".encode())
        _assert_serves(server)  # both are stalled right now
        status, text, _ = _read_response(stalled_body, timeout=BODY_TIMEOUT_S + 30)
        assert status == 408 and "--request-body-timeout" in text
    finally:
        stalled_body.close()
        stalled_head.close()
    _assert_serves(server)


def test_afterwards_it_serves_and_every_block_is_free(server: Server) -> None:
    for case in CASES[:5]:  # the hostile table once more, then a clean bill
        _send(server, case)
    _assert_serves(server)
    stats = _settled_stats(server)
    assert stats["num_used_blocks"] == 0 and stats["num_running"] == 0, stats
    assert stats["num_waiting"] == 0, stats


def _assert_serves(server: Server) -> None:
    r = httpx.post(server.url + CHAT, json=_chat(max_tokens=3), timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text


def _settled_stats(server: Server) -> dict[str, Any]:
    """The scheduler's counters once no request is left in it (aborts may still be in flight
    for a moment after the last response)."""
    headers = {"authorization": f"Bearer {ADMIN}"}

    def settled() -> dict[str, Any] | None:
        stats = httpx.get(server.url + "/admin/stats", headers=headers, timeout=30).json()
        return stats if stats["num_running"] == 0 and stats["num_used_blocks"] == 0 else None

    return wait_until(settled, 60, "nothing running and every block free")


# --- a raw HTTP/1.1 client: one that reads the answer while it is still sending -------------


def _host_port(server: Server) -> tuple[str, int]:
    url = urlparse(server.url)
    assert url.hostname and url.port
    return url.hostname, url.port


def _raw_post(
    server: Server, path: str, body: bytes, headers: dict[str, str], chunked: bool = False
) -> httpx.Response:
    """POST as a client that listens while it sends: a server may refuse a body it has not
    read, and the refusal must reach us rather than a reset."""
    host, port = _host_port(server)
    head = {"host": host, "connection": "close"} | headers
    head.setdefault("content-length", "" if chunked else str(len(body)))
    if chunked:
        del head["content-length"]
        head["transfer-encoding"] = "chunked"
    raw_head = f"POST {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in head.items())
    sock = socket.create_connection((host, port), timeout=60)
    try:
        sock.sendall(raw_head.encode() + b"\r\n")
        for piece in _pieces(body, chunked):
            if select.select([sock], [], [], 0.05)[0]:
                break  # the answer came before the whole body: read it
            try:
                sock.sendall(piece)
            except OSError:
                break
        status, text, headers = _read_response(sock, timeout=60)
    finally:
        sock.close()
    return httpx.Response(status, content=text.encode(), headers=headers)


def _pieces(body: bytes, chunked: bool, size: int = 64 * 1024) -> Iterator[bytes]:
    for i in range(0, len(body), size):
        part = body[i : i + size]
        yield b"%x\r\n%s\r\n" % (len(part), part) if chunked else part
    if chunked:
        yield b"0\r\n\r\n"


def _read_response(sock: socket.socket, timeout: float) -> tuple[int, str, dict[str, str]]:
    sock.settimeout(timeout)
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
        head, sep, rest = data.partition(b"\r\n\r\n")
        length = [
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        ]
        if sep and length and len(rest) >= length[0]:
            break
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 "), data[:200]
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), rest.decode(errors="replace"), headers
