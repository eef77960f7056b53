"""Bad input gets a clear 4xx naming the field (and the limit), and the server goes on."""

from __future__ import annotations

import httpx
import pytest

from tests.server import Server

MSG = [{"role": "user", "content": "hi"}]


def _cases(model: str) -> list[tuple[str, str, object, int, list[str]]]:
    chat, comp = "/v1/chat/completions", "/v1/completions"
    long_prompt = "hello " * 9000  # > 8192 tokens
    return [
        ("missing messages", chat, {"model": model}, 400, ["messages"]),
        ("empty messages", chat, {"model": model, "messages": []}, 400, ["messages"]),
        ("messages not a list", chat, {"model": model, "messages": "hi"}, 400, ["messages"]),
        (
            "content wrong type",
            chat,
            {"model": model, "messages": [{"role": "user", "content": 5}]},
            400,
            ["content"],
        ),
        (
            "max_tokens zero",
            chat,
            {"model": model, "messages": MSG, "max_tokens": 0},
            400,
            ["max_tokens"],
        ),
        (
            "max_tokens negative",
            comp,
            {"model": model, "prompt": "a", "max_tokens": -3},
            400,
            ["max_tokens"],
        ),
        (
            "max_tokens a string",
            chat,
            {"model": model, "messages": MSG, "max_tokens": "5"},
            400,
            ["max_tokens"],
        ),
        (
            "temperature negative",
            chat,
            {"model": model, "messages": MSG, "temperature": -0.1},
            400,
            ["temperature"],
        ),
        ("top_p zero", chat, {"model": model, "messages": MSG, "top_p": 0}, 400, ["top_p"]),
        ("top_p above one", comp, {"model": model, "prompt": "a", "top_p": 1.5}, 400, ["top_p"]),
        ("n above the limit", chat, {"model": model, "messages": MSG, "n": 17}, 400, ["n", "16"]),
        ("empty prompt", comp, {"model": model, "prompt": ""}, 400, ["prompt"]),
        (
            "prompt too long",
            comp,
            {"model": model, "prompt": long_prompt, "max_tokens": 10},
            400,
            ["8192"],
        ),
        (
            "prompt + max_tokens too long",
            comp,
            {"model": model, "prompt": "hello", "max_tokens": 100000},
            400,
            ["max_tokens", "8192"],
        ),
        (
            "token id outside vocab",
            comp,
            {"model": model, "prompt": [1, 2, 999999]},
            400,
            ["prompt", "999999"],
        ),
        (
            "unknown model",
            chat,
            {"model": "no-such-model", "messages": MSG},
            404,
            ["no-such-model"],
        ),
    ]


@pytest.mark.parametrize("index", range(16))
def test_bad_request_gets_4xx_naming_the_field(server: Server, index: int) -> None:
    name, path, body, status, words = _cases(server.model)[index]
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == status, (name, r.status_code, r.text)
    err = r.json()["error"]
    for w in words:
        assert w in err["message"], (name, err)


def test_malformed_json_is_400(server: Server) -> None:
    r = httpx.post(
        server.url + "/v1/chat/completions",
        content=b'{"model": "x", "messa',
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400
    assert "JSON" in r.json()["error"]["message"] or "json" in r.json()["error"]["message"]


def test_server_keeps_serving_after_bad_input(server: Server) -> None:
    r = httpx.post(
        server.url + "/v1/chat/completions",
        timeout=60,
        json={"model": server.model, "messages": MSG, "max_tokens": 4},
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
