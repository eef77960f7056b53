"""Unknown request fields are a 400 naming them, with the field likely meant
(services/gateway/openai/unknown_fields.py), through the real HTTP app on the scripted engine."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import pytest

from common.config import ServerConfig
from services.gateway.http.app import create_app
from services.gateway.openai.chat_protocol import ChatCompletionRequest
from services.gateway.openai.unknown_fields import find_unknown, suggest
from tests.fake_engine import FakeEngine
from tests.unit.services.gateway.http.test_app import CHAT, COMPLETIONS, error_of, run

USER = {"role": "user", "content": "hello there"}


def _chat(**extra: Any) -> dict[str, Any]:
    return {"messages": [USER]} | extra


def test_an_unknown_top_level_field_is_refused_by_name() -> None:
    engine = FakeEngine()
    error = error_of(run(engine, "POST", CHAT, json=_chat(foo=1)), 400)
    assert error["param"] == "foo" and error["message"] == "foo: unknown field"
    error = error_of(run(engine, "POST", COMPLETIONS, json={"prompt": "hi", "foo": 1}), 400)
    assert error["param"] == "foo"
    assert not engine.requests


def test_a_misspelling_names_the_field_meant_and_every_other_unknown_one() -> None:
    engine = FakeEngine()
    error = error_of(run(engine, "POST", CHAT, json=_chat(max_token=50, temprature=0)), 400)
    assert error["param"] == "max_token"
    assert error["message"] == (
        "max_token: unknown field; did you mean `max_tokens`? "
        "(also unknown: temprature; did you mean `temperature`?)"
    )
    assert not engine.requests


def test_unknown_nested_fields_are_refused_by_path() -> None:
    engine = FakeEngine()
    cases = [
        (_chat(messages=[{"role": "user", "contnet": "hi"}]), "messages[0].contnet", "content"),
        (
            _chat(stream=True, stream_options={"include_usag": True}),
            "stream_options.include_usag",
            "include_usage",
        ),
    ]
    for body, param, meant in cases:
        error = error_of(run(engine, "POST", CHAT, json=body), 400)
        assert error["param"] == param and f"did you mean `{meant}`" in error["message"]
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}", "x": 1}}
    body = _chat(messages=[USER, {"role": "assistant", "tool_calls": [call]}])
    error = error_of(run(engine, "POST", CHAT, json=body), 400)
    assert error["param"] == "messages[1].tool_calls[0].function.x"
    assert not engine.requests


def test_known_fields_refused_ignored_or_echoed_are_not_unknown() -> None:
    engine = FakeEngine()
    # on the ignore list; and the keys the openai client sends back with an earlier answer
    replayed = {"role": "assistant", "content": "hi", "refusal": None, "annotations": []}
    body = _chat(metadata={"a": "b"}, store=True, messages=[USER, replayed, USER])
    assert run(engine, "POST", CHAT, json=body).status_code == 200
    error = error_of(run(engine, "POST", CHAT, json=_chat(logits_processors=["x"])), 400)
    assert error["message"].startswith("logits_processors: is not supported")


def test_an_assistant_tool_call_turn_needs_no_content_key() -> None:
    engine = FakeEngine()
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    tool = {"role": "tool", "tool_call_id": "c1", "content": "42"}
    body = _chat(messages=[USER, {"role": "assistant", "tool_calls": [call]}, tool])
    assert run(engine, "POST", CHAT, json=body).status_code == 200
    assistant = engine.requests[-1].messages[1]
    assert assistant["content"] is None and assistant["tool_calls"][0]["id"] == "c1"
    # a user turn still needs its content
    error = error_of(run(engine, "POST", CHAT, json=_chat(messages=[{"role": "user"}])), 400)
    assert error["param"] == "messages[0].content"


def test_ignore_unknown_fields_logs_a_warning_instead(caplog: pytest.LogCaptureFixture) -> None:
    engine = FakeEngine()

    async def go() -> httpx.Response:
        app = create_app(engine, ServerConfig(ignore_unknown_fields=True))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(CHAT, json=_chat(max_token=50, foo={"x": 1}))

    with caplog.at_level(logging.WARNING, logger="shuttle.gateway"):
        assert asyncio.run(go()).status_code == 200
    assert engine.requests[-1].sampling.max_tokens == 0  # max_token changed nothing
    assert any("max_token, foo" in r.getMessage() for r in caplog.records)


def test_find_unknown_and_suggest() -> None:
    body = {"messages": [USER, {"role": "user", "content": "x", "nme": "a"}], "n": 1}
    assert find_unknown(body, ChatCompletionRequest) == [(("messages", 1, "nme"), "name")]
    assert suggest("temprature", ["temperature", "top_p"]) == "temperature"
    assert suggest("foo", ["temperature", "top_p"]) is None


def test_tokenize_routes_and_json_objects_of_their_own_name_the_field_meant() -> None:
    engine = FakeEngine()
    error = error_of(run(engine, "POST", "/tokenize", json={"prompt": "hi", "add_special": 1}), 400)
    assert error["param"] == "add_special" and "`add_special_tokens`" in error["message"]
    error = error_of(run(engine, "POST", "/detokenize", json={"token": [1]}), 400)
    assert error["param"] == "token" and "`tokens`" in error["message"]
    tool = {"type": "function", "function": {"name": "f", "paramters": {"type": "object"}}}
    error = error_of(run(engine, "POST", CHAT, json=_chat(tools=[tool])), 400)
    assert error["param"] == "tools[0].function.paramters"
    assert "did you mean `parameters`" in error["message"]
