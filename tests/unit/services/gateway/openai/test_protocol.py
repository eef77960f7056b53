"""No field is silently ignored: every field of OpenAI's chat and completions request
schemas (from the installed `openai` package) and every vLLM extension we know of is either
honoured (it changes what reaches the engine, or the answer's shape), refused with a 400
naming it, or on the short documented ignore list (services/gateway/openai/refused.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from common.messages import GenerateRequest
from services.gateway.openai.chat_protocol import ChatCompletionRequest
from services.gateway.openai.completions_protocol import CompletionRequest
from services.gateway.openai.refused import (
    IGNORED_FIELDS,
    REFUSED_CHAT,
    REFUSED_COMPLETION,
    check_disjoint,
)
from tests.fake_engine import FakeEngine
from tests.unit.services.gateway.http.test_app import CHAT, COMPLETIONS, error_of, run

openai = pytest.importorskip("openai")
from openai.types import completion_create_params as completion_params  # noqa: E402
from openai.types.chat import completion_create_params as chat_params  # noqa: E402

# vLLM's extensions of both APIs (its SamplingParams and request models), and ours
VLLM_EXTRAS = {
    "top_k", "min_p", "repetition_penalty", "length_penalty", "min_tokens", "bad_words",
    "ignore_eos", "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "allowed_token_ids",
    "prompt_logprobs", "use_beam_search", "logits_processors", "return_tokens_as_token_ids",
    "return_token_ids", "priority", "request_id", "cache_salt", "kv_transfer_params",
    "vllm_xargs", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern",
    "response_format", "add_special_tokens", "timeout", "detokenize",
}  # fmt: skip
VLLM_CHAT_EXTRAS = {
    "add_generation_prompt", "continue_final_message", "echo", "documents", "chat_template",
    "chat_template_kwargs", "mm_processor_kwargs",
}  # fmt: skip

# honoured: a value that changes the engine's request
CHANGES_THE_REQUEST: dict[str, Any] = {
    "max_tokens": 7,
    "max_completion_tokens": 7,
    "temperature": 0.5,
    "top_p": 0.5,
    "top_k": 5,
    "seed": 3,
    "stop": ["x"],
    "stop_token_ids": [9],
    "n": 2,
    "ignore_eos": True,
    "priority": 3,  # under --scheduling-policy priority (fcfs: refused, below)
    "timeout": 5.0,
    "add_generation_prompt": False,
    "truncate_prompt_tokens": 5,
    "allowed_token_ids": [5, 6],
    "cache_salt": "a-secret-salt",
    "include_stop_str_in_output": True,
    "skip_special_tokens": False,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
    "repetition_penalty": 1.2,
    "min_p": 0.1,
    "min_tokens": 2,
    "logit_bias": {"5": 1.0},
    "bad_words": ["nope"],
    "chat_template_kwargs": {"enable_thinking": False},
    "chat_template": "{{ messages[0]['content'] }}",  # with --trust-request-chat-template
    # structured outputs: each asks for a grammar (services/gateway/openai/structured.py)
    "response_format": {"type": "json_object"},
    "structured_outputs": {"regex": "[a-z]+"},
    "guided_json": {"type": "object"},
    "guided_regex": "[a-z]+",
    "guided_choice": ["yes", "no"],
    "guided_grammar": 'root ::= "a"',
}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
# honoured: a body (per endpoint) that changes the engine's request through the field
CHANGES_THE_REQUEST_BY_URL: dict[tuple[str, str], dict[str, Any]] = {
    (CHAT, "logprobs"): {"logprobs": True},
    (COMPLETIONS, "logprobs"): {"logprobs": 2},
    (CHAT, "top_logprobs"): {"logprobs": True, "top_logprobs": 2},
    (CHAT, "prompt_logprobs"): {"prompt_logprobs": 1},
    # beam search: the engine gets one-token steps asking for logprobs
    (CHAT, "use_beam_search"): {"use_beam_search": True, "max_tokens": 2},
    (COMPLETIONS, "use_beam_search"): {"use_beam_search": True, "max_tokens": 2},
    (CHAT, "length_penalty"): {"use_beam_search": True, "max_tokens": 2, "length_penalty": 0.5},
    (COMPLETIONS, "length_penalty"): {
        "use_beam_search": True,
        "max_tokens": 2,
        "length_penalty": 0.5,
    },
    # special tokens: chat's default is without them, completions' with them
    (CHAT, "add_special_tokens"): {"add_special_tokens": True},
    (COMPLETIONS, "add_special_tokens"): {"add_special_tokens": False},
    (CHAT, "continue_final_message"): {
        "continue_final_message": True,
        "add_generation_prompt": False,
    },
    (COMPLETIONS, "prompt_logprobs"): {"prompt_logprobs": 1},
    # tools change the prompt (the tool list) and, forced, the grammar
    (CHAT, "tools"): {"tools": [TOOL]},
    (CHAT, "tool_choice"): {"tools": [TOOL], "tool_choice": "required"},
    (CHAT, "parallel_tool_calls"): {
        "tools": [TOOL],
        "tool_choice": "required",
        "parallel_tool_calls": False,
    },
}
# honoured: the body's fields (with what they need) that shape the answer, not the request
SHAPES_THE_ANSWER: dict[str, dict[str, Any]] = {
    "model": {"model": "test-model"},
    "messages": {},
    "prompt": {},
    "stream": {"stream": True},
    "stream_options": {"stream": True, "stream_options": {"include_usage": True}},
    "return_token_ids": {"return_token_ids": True},
    "detokenize": {"detokenize": False},  # token ids, no text
    "return_tokens_as_token_ids": {"return_tokens_as_token_ids": True},
    "best_of": {"best_of": 1},  # = n: no ranking of choices
    "echo": {"echo": True},  # completions: the prompt; chat: the last message's text
}
# declared fields refused, with a message of their own, when they ask for something
REFUSED_BY_THEIR_MODEL: dict[str, Any] = {
    "suffix": "and then",
}
ASKS_FOR_SOMETHING = {"asks": "for something"}  # not the no-op value of any refused field

CHAT_FIELDS = sorted(
    set(chat_params.CompletionCreateParamsBase.__annotations__)
    | {"stream"}
    | VLLM_EXTRAS
    | VLLM_CHAT_EXTRAS
)
COMPLETION_FIELDS = sorted(
    set(completion_params.CompletionCreateParamsBase.__annotations__) | {"stream"} | VLLM_EXTRAS
)


def _body(url: str) -> dict[str, Any]:
    if url == CHAT:
        return {"messages": [{"role": "user", "content": "hello there"}]}
    return {"prompt": "hello there"}


def _sent(engine: FakeEngine) -> GenerateRequest:
    """What reached the engine, less what differs between any two requests."""
    return dataclasses.replace(engine.requests[-1], request_id="", arrival_time=0.0)


def _check(url: str, field: str, refused: dict[str, Any]) -> str:
    engine = FakeEngine()
    assert run(engine, "POST", url, policy="priority", json=_body(url)).status_code == 200
    baseline = _sent(engine)
    if field in IGNORED_FIELDS:
        body = _body(url) | {field: "some-value"}
        assert run(engine, "POST", url, json=body).status_code == 200
        assert _sent(engine) == baseline, f"{field} is on the ignore list yet changed the request"
        return "ignored"
    if field in refused or field in REFUSED_BY_THEIR_MODEL:
        value = REFUSED_BY_THEIR_MODEL.get(field, ASKS_FOR_SOMETHING)
        error = error_of(run(engine, "POST", url, json=_body(url) | {field: value}), 400)
        assert error["param"] == field and error["message"].startswith(f"{field}: ")
        assert len(engine.requests) == 1
        return "refused"
    if field in CHANGES_THE_REQUEST or (url, field) in CHANGES_THE_REQUEST_BY_URL:
        extra = CHANGES_THE_REQUEST_BY_URL.get((url, field)) or {field: CHANGES_THE_REQUEST[field]}
        body = _body(url) | extra
        assert (
            run(
                engine, "POST", url, policy="priority", trust_chat_template=True, json=body
            ).status_code
            == 200
        )
        assert _sent(engine) != baseline, f"{field} was accepted but changed nothing"
        return "honoured"
    if field in SHAPES_THE_ANSWER:
        body = _body(url) | SHAPES_THE_ANSWER[field]
        assert run(engine, "POST", url, json=body).status_code == 200
        return "honoured"
    raise AssertionError(f"{url} field {field!r} is neither honoured, refused nor ignored")


@pytest.mark.parametrize("field", CHAT_FIELDS)
def test_every_chat_field_is_honoured_refused_or_ignored(field: str) -> None:
    _check(CHAT, field, REFUSED_CHAT)


@pytest.mark.parametrize("field", COMPLETION_FIELDS)
def test_every_completions_field_is_honoured_refused_or_ignored(field: str) -> None:
    _check(COMPLETIONS, field, REFUSED_COMPLETION)


def test_sampling_controls_not_implemented_yet_are_refused_not_ignored() -> None:
    for field in ("logits_processors",):
        for url in (CHAT, COMPLETIONS):
            assert _check(url, field, REFUSED_CHAT if url == CHAT else REFUSED_COMPLETION) == (
                "refused"
            )


def test_logprobs_are_honoured() -> None:
    for url in (CHAT, COMPLETIONS):
        refused = REFUSED_CHAT if url == CHAT else REFUSED_COMPLETION
        for field in ("logprobs", "prompt_logprobs"):
            assert _check(url, field, refused) == "honoured"
    assert _check(CHAT, "top_logprobs", REFUSED_CHAT) == "honoured"
    assert _check(COMPLETIONS, "echo", REFUSED_COMPLETION) == "honoured"
    assert _check(CHAT, "echo", REFUSED_CHAT) == "honoured"


def test_the_sampling_controls_are_honoured() -> None:
    for field in ("min_p", "logit_bias", "min_tokens", "bad_words", "repetition_penalty"):
        for url in (CHAT, COMPLETIONS):
            assert _check(url, field, REFUSED_CHAT if url == CHAT else REFUSED_COMPLETION) == (
                "honoured"
            )


def test_the_no_op_value_of_a_refused_field_is_accepted() -> None:
    engine = FakeEngine()
    body = _body(CHAT) | {"function_call": "none", "modalities": ["text"]}
    assert run(engine, "POST", CHAT, json=body).status_code == 200
    error = error_of(run(engine, "POST", CHAT, json=_body(CHAT) | {"function_call": "auto"}), 400)
    assert error["message"] == (
        'function_call: is not supported by this server; only "none" (or null) is accepted'
    )
    # honoured fields' values that ask for nothing
    body = _body(CHAT) | {"tools": [], "tool_choice": "none", "response_format": {"type": "text"}}
    assert run(engine, "POST", CHAT, json=body).status_code == 200


def test_every_declared_field_is_walked() -> None:
    """A field added to a request model must be classified above."""
    for model, walked in (
        (ChatCompletionRequest, CHAT_FIELDS),
        (CompletionRequest, COMPLETION_FIELDS),
    ):
        assert set(model.model_fields) <= set(walked), model.__name__


def test_priority_needs_the_priority_policy() -> None:
    engine = FakeEngine()
    error = error_of(run(engine, "POST", CHAT, json=_body(CHAT) | {"priority": 1}), 400)
    assert error["param"] == "priority" and "--scheduling-policy priority" in error["message"]
    assert run(engine, "POST", CHAT, json=_body(CHAT) | {"priority": 0}).status_code == 200
    body = _body(COMPLETIONS) | {"priority": -1}
    assert run(engine, "POST", COMPLETIONS, policy="priority", json=body).status_code == 200
    assert engine.requests[-1].priority == -1


def test_stream_options_without_stream_is_refused() -> None:
    for url in (CHAT, COMPLETIONS):
        for stream in ({}, {"stream": False}):
            body = _body(url) | stream | {"stream_options": {"include_usage": True}}
            error = error_of(run(FakeEngine(), "POST", url, json=body), 400)
            assert error["param"] == "stream_options" and "stream is true" in error["message"]


def test_a_field_cannot_be_both_honoured_and_refused() -> None:
    # implementing a refused field means moving it out of refused.py, or import fails
    with pytest.raises(TypeError, match="guided_decoding_backend"):
        check_disjoint(
            {"guided_decoding_backend": None, "top_k": None}, REFUSED_CHAT, "ChatCompletionRequest"
        )


def test_a_request_chat_template_needs_the_operators_trust() -> None:
    engine = FakeEngine()
    body = _body(CHAT) | {"chat_template": "{{ messages[0]['content'] }}"}
    error = error_of(run(engine, "POST", CHAT, json=body), 400)
    assert error["param"] == "chat_template"
    assert "--trust-request-chat-template" in error["message"]
    assert not engine.requests
    assert run(engine, "POST", CHAT, trust_chat_template=True, json=body).status_code == 200
    assert engine.requests[-1].chat_template == "{{ messages[0]['content'] }}"


def test_chat_template_kwargs_reach_the_engine_and_are_bounded() -> None:
    engine = FakeEngine()
    body = _body(CHAT) | {"chat_template_kwargs": {"enable_thinking": False}}
    assert run(engine, "POST", CHAT, json=body).status_code == 200
    assert engine.requests[-1].chat_template_kwargs == {"enable_thinking": False}
    for kwargs in ({"x": "y" * 70_000}, {"x": 2**70}):
        body = _body(CHAT) | {"chat_template_kwargs": kwargs}
        assert error_of(run(engine, "POST", CHAT, json=body), 400)["param"] == (
            "chat_template_kwargs"
        )
    assert len(engine.requests) == 1
