"""POST /tokenize and /detokenize against the fake engine (its tokenizer: characters as
ids), in process: vLLM's shapes and defaults, refusals naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from services.gateway.engine.client import RequestFailed
from tests.fake_engine import MODEL, FakeEngine
from tests.unit.services.gateway.http.test_app import error_of, run

CHAT = [{"role": "user", "content": "hi"}]


def test_tokenize_a_prompt() -> None:
    engine = FakeEngine()
    out = run(engine, "POST", "/tokenize", json={"model": MODEL, "prompt": "abc"}).json()
    assert out == {"count": 4, "max_model_len": 256, "tokens": [1, 97, 98, 99], "token_strs": None}
    body = {"prompt": "abc", "add_special_tokens": False}
    assert run(engine, "POST", "/tokenize", json=body).json()["tokens"] == [97, 98, 99]
    assert engine.tokenized == [("abc", None, True, True), ("abc", None, False, True)]
    assert engine.requests == []  # nothing was generated


def test_tokenize_messages_as_vllm_defaults_them() -> None:
    engine = FakeEngine()
    out = run(engine, "POST", "/tokenize", json={"messages": CHAT}).json()
    assert out["tokens"] == [104, 105, 2]  # no special tokens, the generation prompt
    body = {"messages": CHAT, "add_generation_prompt": False, "add_special_tokens": True}
    assert run(engine, "POST", "/tokenize", json=body).json()["tokens"] == [1, 104, 105]
    assert engine.tokenized[0] == (None, CHAT, False, True)


def test_detokenize() -> None:
    engine = FakeEngine()
    out = run(engine, "POST", "/detokenize", json={"model": MODEL, "tokens": [104, 105]})
    assert out.json() == {"prompt": "hi"}


@pytest.mark.parametrize(
    ("url", "body", "field"),
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "x", "messages": CHAT}, "prompt"),
        ("/tokenize", {"prompt": ""}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role"),
        ("/tokenize", {"prompt": "x", "return_token_strs": True}, "return_token_strs"),
        ("/detokenize", {}, "tokens"),
        ("/detokenize", {"tokens": [1, -1]}, "tokens[1]"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ],
)
def test_bad_input_is_400_naming_the_field(url: str, body: dict[str, Any], field: str) -> None:
    engine = FakeEngine()
    error = error_of(run(engine, "POST", url, json=body), 400)
    assert error["param"] == field and error["message"].startswith(field)
    assert engine.tokenized == []


def test_the_tokenizers_refusal_and_silence() -> None:
    engine = FakeEngine()
    engine.tokenize_failure = RequestFailed(400, "tokens: token id 9 is outside", "tokens")
    error = error_of(run(engine, "POST", "/detokenize", json={"tokens": [9]}), 400)
    assert (error["param"], error["message"]) == ("tokens", "tokens: token id 9 is outside")
    engine.tokenize_failure = TimeoutError()
    resp = run(engine, "POST", "/tokenize", json={"prompt": "x"})
    assert "no tokenizer answered" in error_of(resp, 503)["message"]
    assert resp.headers["retry-after"] == "1"


def test_unknown_model_not_ready_and_api_key() -> None:
    engine = FakeEngine()
    error_of(run(engine, "POST", "/tokenize", json={"model": "nope", "prompt": "x"}), 404)
    error_of(run(engine, "POST", "/detokenize", api_key="k", json={"tokens": [1]}), 401)
    good = {"Authorization": "Bearer k"}
    resp = run(engine, "POST", "/detokenize", api_key="k", json={"tokens": [104]}, headers=good)
    assert resp.json() == {"prompt": "h"}
    engine.ready = False
    error_of(run(engine, "POST", "/tokenize", json={"prompt": "x"}), 503)


def test_tokenize_messages_with_a_template_and_its_kwargs() -> None:
    engine = FakeEngine()
    kwargs = {"enable_thinking": False}
    body = {"messages": CHAT, "chat_template_kwargs": kwargs}
    assert run(engine, "POST", "/tokenize", json=body).status_code == 200
    body = {"messages": CHAT, "chat_template": "{{ messages }}"}
    assert run(engine, "POST", "/tokenize", trust_chat_template=True, json=body).status_code == 200
    assert engine.tokenize_templates == [(None, kwargs), ("{{ messages }}", None)]
    # as a chat request: a client's template wants the operator's trust
    error = error_of(run(engine, "POST", "/tokenize", json=body), 400)
    assert (
        error["param"] == "chat_template" and "--trust-request-chat-template" in (error["message"])
    )
    for field, value in (("chat_template_kwargs", kwargs), ("chat_template", "{{ x }}")):
        body = {"prompt": "abc", field: value}
        error = error_of(run(engine, "POST", "/tokenize", trust_chat_template=True, json=body), 400)
        assert error["param"] == field and "only with `messages`" in error["message"]
    assert len(engine.tokenized) == 2
