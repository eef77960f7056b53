"""The gateway's gRPC front end against the scripted fake engine, on a loopback port in this
process: conversion, validation identical to HTTP, status mapping, cancellation, auth,
health and reflection."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
from google.protobuf.internal import encoder
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from common.config import SchedulerConfig, ServerConfig
from common.messages import FinishReason
from proto import shuttle_pb2 as pb
from proto import shuttle_pb2_grpc as pb_grpc
from services.gateway.engine.client import RequestFailed
from services.gateway.grpc.server import GrpcGateway
from tests.fake_engine import HANG, MODEL, FakeEngine, delta
from tests.unit.services.gateway.http.test_app import CHAT, COMPLETIONS, LENGTH, STOP
from tests.unit.services.gateway.http.test_app import run as run_http
from tests.waiting import wait_until_async

Code = grpc.StatusCode
TOKEN = "admin-secret"


@contextlib.asynccontextmanager
async def serving(
    engine: FakeEngine, policy: str = "fcfs", **kw: Any
) -> AsyncIterator[grpc.aio.Channel]:
    server = ServerConfig(host="127.0.0.1", grpc_port=0, **kw)
    scheduler = SchedulerConfig(scheduling_policy=policy)
    gateway = GrpcGateway(engine, server, scheduler, health_poll_s=0.02)
    port = await gateway.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel
    finally:
        await gateway.stop(grace=0)


def run(engine: FakeEngine, test: Callable[[grpc.aio.Channel], Awaitable[Any]], **kw: Any) -> Any:
    async def go() -> Any:
        async with serving(engine, **kw) as channel:
            return await test(channel)

    return asyncio.run(go())


async def generate(channel: grpc.aio.Channel, **fields: Any) -> list[pb.GenerateResponse]:
    return [r async for r in pb_grpc.ShuttleStub(channel).Generate(pb.GenerateRequest(**fields))]


def refusal(engine: FakeEngine, **fields: Any) -> grpc.aio.AioRpcError:
    async def test(channel: grpc.aio.Channel) -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate(channel, **fields)
        return info.value

    return run(engine, test)


# --- Generate --------------------------------------------------------------------------------


def test_generate_streams_deltas_then_finish_and_usage() -> None:
    engine = FakeEngine()

    async def test(channel: grpc.aio.Channel) -> None:
        call = pb_grpc.ShuttleStub(channel).Generate(
            pb.GenerateRequest(request_id="my-id.1", text="hello big world")
        )
        out = [r async for r in call]
        assert ("x-request-id", "my-id.1") in list(await call.initial_metadata())
        assert [r.text for r in out] == [" hello", " big", " world"]
        assert [list(r.token_ids) for r in out] == [[7], [7, 7], [7, 7, 7]]
        assert {r.request_id for r in out} == {"my-id.1"}
        assert [r.finish_reason for r in out] == [0, 0, pb.FINISH_REASON_STOP]
        assert not out[0].HasField("usage") and out[0].system_fingerprint == ""
        assert (out[-1].usage.prompt_tokens, out[-1].usage.completion_tokens) == (5, 3)
        assert out[-1].usage.total_tokens == 8 and out[-1].system_fingerprint == "v-test"

    run(engine, test)
    assert engine.requests[0].prompt == "hello big world" and not engine.aborted


def test_requests_convert_as_the_http_api_converts_them() -> None:
    engine = FakeEngine()
    chat = pb.Chat(
        messages=[
            pb.ChatMessage(role="developer", content="be brief", name="a"),
            pb.ChatMessage(role="user", content="hi there"),
        ],
        add_generation_prompt=False,
    )

    async def test(channel: grpc.aio.Channel) -> None:
        await generate(channel, text="a b", model=MODEL)
        await generate(
            channel,
            token_ids=pb.TokenIds(ids=[1, 2, 3]),
            temperature=0.0,
            top_p=0.5,
            top_k=-1,
            seed=3,
            stop=["x"],
            stop_token_ids=[9],
            max_tokens=9,
            ignore_eos=True,
        )
        out = await generate(channel, chat=chat)
        assert out[0].request_id.startswith("gen-")

    run(engine, test)
    text, ids, chatted = engine.requests
    assert text.prompt == "a b" and text.sampling.max_tokens == 16  # as /v1/completions
    assert text.sampling.temperature == 1.0 and text.sampling.seed is None
    assert ids.prompt_token_ids == [1, 2, 3] and ids.prompt is None
    s = ids.sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed, s.max_tokens) == (0.0, 0.5, 0, 3, 9)
    assert (s.stop, s.stop_token_ids, s.ignore_eos) == (["x"], [9], True)
    assert chatted.messages == [
        {"role": "system", "content": "be brief", "name": "a"},
        {"role": "user", "content": "hi there"},
    ]
    assert chatted.sampling.max_tokens == 0 and chatted.add_generation_prompt is False


def test_structured_outputs_convert_as_the_http_api_converts_them() -> None:
    engine = FakeEngine()
    specs = [
        pb.StructuredOutputs(json='{"type": "object", "properties": {"a": {"maximum": 3}}}'),
        pb.StructuredOutputs(json_object=True),
        pb.StructuredOutputs(regex="[a-z]+"),
        pb.StructuredOutputs(choice=pb.Choices(choices=["yes", "no"])),
        pb.StructuredOutputs(grammar='root ::= "a"'),
    ]

    async def test(channel: grpc.aio.Channel) -> None:
        for spec in specs:
            await generate(channel, text="x", structured_outputs=spec)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await generate(channel, text="x", structured_outputs=pb.StructuredOutputs())
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (e.value.details() or "").startswith("structured_outputs: ")

    run(engine, test)
    got = [(r.sampling.structured_kind, r.sampling.structured_field) for r in engine.requests]
    assert got == [
        ("json", "structured_outputs.json"),
        ("json_object", "structured_outputs.json_object"),
        ("regex", "structured_outputs.regex"),
        ("choice", "structured_outputs.choice"),
        ("grammar", "structured_outputs.grammar"),
    ]
    assert engine.requests[0].sampling.structured_spec == (
        '{"type":"object","properties":{"a":{"maximum":3}}}'  # an int stays an int
    )


def test_tools_convert_as_over_http_and_calls_come_back_on_the_last_message() -> None:
    call_text = '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
    engine = FakeEngine(script=[delta("Let me see. <tool"), delta(call_text[5:], STOP)])
    tools = [pb.Tool(name="weather", description="d", parameters='{"type": "object"}')]
    earlier = pb.ToolCall(id="c1", name="weather", arguments='{"city": "Rome"}')
    chat = pb.Chat(
        messages=[
            pb.ChatMessage(role="user", content="weather?"),
            pb.ChatMessage(role="assistant", tool_calls=[earlier]),
            pb.ChatMessage(role="tool", content="21C", tool_call_id="c1"),
        ],
        tools=tools,
    )

    async def test(channel: grpc.aio.Channel) -> list[pb.GenerateResponse]:
        out = await generate(channel, chat=chat)
        bad = pb.Chat(messages=chat.messages[:1], tools=tools, tool_choice="nope")
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await generate(channel, chat=bad)
        assert (e.value.details() or "").startswith("chat.tool_choice.function.name: ")
        broken = pb.Chat(messages=chat.messages[:1], tools=[pb.Tool(name="f", parameters="{")])
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await generate(channel, chat=broken)
        assert (e.value.details() or "").startswith("chat.tools[0].parameters: ")
        return out

    out = run(engine, test)
    assert "".join(r.text for r in out) == "Let me see. "
    (call,) = out[-1].tool_calls
    assert call.name == "weather" and call.arguments == '{"city":"Oslo"}'
    assert out[-1].finish_reason == pb.FINISH_REASON_TOOL_CALLS
    sent = engine.requests[0]  # the conversation as sent; the tokenizer renders the tools
    assert [fn["name"] for fn in sent.tools] == ["weather"]
    assert sent.messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Rome"}'
    assert sent.messages[2] == {"role": "tool", "content": "21C", "tool_call_id": "c1"}


def test_sampling_controls_convert_as_the_http_api_converts_them() -> None:
    engine = FakeEngine()
    controls: dict[str, Any] = dict(
        presence_penalty=0.5,
        frequency_penalty=-1.0,
        repetition_penalty=1.2,
        min_p=0.1,
        min_tokens=2,
        max_tokens=8,
        bad_words=["foo", "bar"],
    )

    async def test(channel: grpc.aio.Channel) -> None:
        await generate(channel, text="a b", logit_bias={7: 3.5, 2: -100.0}, **controls)
        await generate(channel, text="a b", top_k=0)

    run(engine, test)
    body = {"prompt": "a b", "logit_bias": {"7": 3.5, "2": -100.0}} | controls
    assert run_http(engine, "POST", COMPLETIONS, json=body).status_code == 200
    assert run_http(engine, "POST", COMPLETIONS, json={"prompt": "a b", "top_k": 0})
    grpc_controls, grpc_plain, http_controls, http_plain = engine.requests
    assert grpc_controls.sampling == http_controls.sampling
    assert grpc_controls.sampling.has_controls and grpc_controls.sampling.min_tokens == 2
    assert (
        grpc_controls.unset_sampling
        == http_controls.unset_sampling
        == ["temperature", "top_p", "top_k"]
    )
    assert grpc_plain.sampling == http_plain.sampling
    assert grpc_plain.unset_sampling == http_plain.unset_sampling
    assert "top_k" not in grpc_plain.unset_sampling  # set, though to its default


def test_logprobs_convert_as_the_http_api_converts_them() -> None:
    engine = FakeEngine()
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="hi")])

    async def test(channel: grpc.aio.Channel) -> None:
        await generate(channel, text="a b", logprobs=3, prompt_logprobs=2)
        await generate(channel, chat=chat, logprobs=0, prompt_logprobs=1)
        await generate(channel, text="a b")

    run(engine, test)
    completion = {"prompt": "a b", "logprobs": 3, "prompt_logprobs": 2}
    assert run_http(engine, "POST", COMPLETIONS, json=completion).status_code == 200
    chatted = {"messages": [_USER], "logprobs": True, "top_logprobs": 0, "prompt_logprobs": 1}
    assert run_http(engine, "POST", CHAT, json=chatted).status_code == 200
    grpc_text, grpc_chat, grpc_plain, http_text, http_chat = engine.requests
    assert grpc_text.sampling == http_text.sampling
    assert (grpc_text.sampling.logprobs, grpc_text.sampling.prompt_logprobs) == (3, 2)
    assert grpc_chat.sampling == http_chat.sampling
    assert (grpc_chat.sampling.logprobs, grpc_chat.sampling.prompt_logprobs) == (0, 1)
    assert (grpc_plain.sampling.logprobs, grpc_plain.sampling.prompt_logprobs) == (None, None)


def test_responses_carry_the_logprobs_of_their_tokens_and_the_prompt() -> None:
    from tests.unit.services.gateway.openai.test_logprobs import BANG, HI, PROMPT, _engine

    engine = _engine()  # " hi" then "!", with the prompt's entries in the first delta
    out = run(engine, lambda c: generate(c, text="ab", logprobs=2, prompt_logprobs=2))
    assert [[e.token for e in r.logprobs] for r in out] == [[" hi"], ["!"]]
    for response, entry in zip(out, (HI, BANG), strict=True):
        (got,) = response.logprobs
        assert (got.token_id, got.logprob) == (entry.token_id, entry.logprob)
        top = [(t.token_id, t.token, t.logprob) for t in got.top_logprobs]
        assert top == entry.top  # best first, as the engine ranked them
    first, second = out[0].prompt_logprobs, out[1].prompt_logprobs
    assert [e.token_id for e in first] == [e.token_id for e in PROMPT] and not second
    assert not first[0].HasField("logprob") and not first[0].top_logprobs  # nothing precedes
    assert first[1].logprob == -3.0 and [t.token for t in first[1].top_logprobs] == ["c", "b"]
    # without return_token_ids the entries still name their tokens
    out = run(_engine(), lambda c: generate(c, text="ab", logprobs=2, return_token_ids=False))
    assert not out[0].token_ids and out[0].logprobs[0].token_id == HI.token_id


def test_a_request_without_logprobs_gets_none() -> None:
    out = run(FakeEngine(), lambda c: generate(c, text="a b"))
    assert not any(r.logprobs or r.prompt_logprobs for r in out)


# a value other than the default for every field of GenerateRequest (but the two below)
_WALK: dict[str, dict[str, Any]] = {
    "request_id": {"request_id": "walk-1"},
    "text": {"text": "c d"},
    "chat": {"chat": pb.Chat(messages=[pb.ChatMessage(role="user", content="hi")])},
    "token_ids": {"token_ids": pb.TokenIds(ids=[1, 2])},
    "max_tokens": {"max_tokens": 3},
    "temperature": {"temperature": 0.5},
    "top_p": {"top_p": 0.5},
    "top_k": {"top_k": 4},
    "seed": {"seed": 7},
    "stop": {"stop": ["x"]},
    "stop_token_ids": {"stop_token_ids": [9]},
    "ignore_eos": {"ignore_eos": True},
    "presence_penalty": {"presence_penalty": 0.5},
    "frequency_penalty": {"frequency_penalty": 0.5},
    "repetition_penalty": {"repetition_penalty": 1.1},
    "min_p": {"min_p": 0.1},
    "min_tokens": {"min_tokens": 2},
    "logit_bias": {"logit_bias": {5: 1.0}},
    "bad_words": {"bad_words": ["foo"]},
    "n": {"n": 2},
    "priority": {"priority": 1},
    "timeout": {"timeout": 5.0},
    "logprobs": {"logprobs": 2},
    "prompt_logprobs": {"prompt_logprobs": 2},
    "structured_outputs": {"structured_outputs": pb.StructuredOutputs(regex="[ab]+")},
}


def test_every_field_of_generate_request_is_honoured() -> None:
    """A new proto field without an entry above fails here: each one changes the engine's
    request; `model` picks (or refuses) the model and `return_token_ids` the responses."""
    names = {f.name for f in pb.GenerateRequest.DESCRIPTOR.fields}
    assert names == set(_WALK) | {"model", "return_token_ids"}
    engine = FakeEngine()

    async def test(channel: grpc.aio.Channel) -> list[list[pb.GenerateResponse]]:
        return [await generate(channel, **{"text": "a b"} | f) for f in [{}, *_WALK.values()]]

    run(engine, test, policy="priority")

    def seen(request: Any) -> dict[str, Any]:
        # (request ids differ anyway: the server picks one when the client does not)
        fresh = request.request_id.startswith("gen-")
        return (
            dataclasses.asdict(request)
            | {"arrival_time": 0.0}
            | ({"request_id": ""} if fresh else {})
        )

    plain, *walked = (seen(r) for r in engine.requests)
    for name, request in zip(_WALK, walked, strict=True):
        assert request != plain, name
    assert walked[0]["request_id"] == "walk-1"
    assert refusal(FakeEngine(), text="x", model="other").code() == Code.NOT_FOUND
    out = run(FakeEngine(), lambda c: generate(c, text="a b", return_token_ids=False))
    assert out and not any(r.token_ids for r in out)


def _unknown_field(number: int) -> bytes:
    """A field this proto lacks, as a newer client would send it (a varint, value 1)."""
    return encoder._VarintBytes(number << 3) + b"\x01"


def test_a_field_the_server_does_not_know_is_refused_by_number() -> None:
    engine = FakeEngine()
    top = pb.GenerateRequest.FromString(
        pb.GenerateRequest(text="x").SerializeToString() + _unknown_field(40)
    )
    message = pb.ChatMessage(role="user", content="x")
    inner = pb.ChatMessage.FromString(message.SerializeToString() + _unknown_field(9))
    nested = pb.GenerateRequest(chat=pb.Chat(messages=[message, inner]))

    async def test(channel: grpc.aio.Channel) -> list[grpc.aio.AioRpcError]:
        errors = []
        for request in (top, nested):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                [r async for r in pb_grpc.ShuttleStub(channel).Generate(request)]
            errors.append(info.value)
        return errors

    top_error, nested_error = run(engine, test)
    assert top_error.code() == nested_error.code() == Code.INVALID_ARGUMENT
    assert top_error.details() == (
        "field 40: unknown to this server's shuttle.v1.GenerateRequest; it is not implemented here"
    )
    assert nested_error.details().startswith(
        "chat.messages[1]: field 9: unknown to this server's shuttle.v1.ChatMessage"
    )
    assert not engine.requests


_USER = {"role": "user", "content": "hi"}
# (proto fields, HTTP path, HTTP body, HTTP headers, HTTP field -> proto field)
_BAD_INPUTS = [
    ({"text": "x", "temperature": 3.0}, COMPLETIONS, {"prompt": "x", "temperature": 3.0}, {}, {}),
    ({"text": "x", "top_p": 0.0}, COMPLETIONS, {"prompt": "x", "top_p": 0.0}, {}, {}),
    ({"text": "x", "top_k": -2}, COMPLETIONS, {"prompt": "x", "top_k": -2}, {}, {}),
    ({"text": "x", "max_tokens": 0}, COMPLETIONS, {"prompt": "x", "max_tokens": 0}, {}, {}),
    ({"text": "x", "max_tokens": 999}, COMPLETIONS, {"prompt": "x", "max_tokens": 999}, {}, {}),
    (
        {"text": "x", "temperature": float("nan")},
        None,
        None,
        {},
        "temperature: must be a finite number, got nan",
    ),
    ({"text": "x", "stop": [""]}, COMPLETIONS, {"prompt": "x", "stop": [""]}, {}, {}),
    ({"text": "x", "stop": ["s"] * 65}, COMPLETIONS, {"prompt": "x", "stop": ["s"] * 65}, {}, {}),
    (
        {"text": "x", "stop_token_ids": [1] * 65},
        COMPLETIONS,
        {"prompt": "x", "stop_token_ids": [1] * 65},
        {},
        {},
    ),
    (
        {"text": "x", "stop_token_ids": [2**31]},
        COMPLETIONS,
        {"prompt": "x", "stop_token_ids": [2**31]},
        {},
        {},
    ),
    ({"text": ""}, COMPLETIONS, {"prompt": ""}, {}, {"prompt": "text"}),
    ({"token_ids": pb.TokenIds()}, COMPLETIONS, {"prompt": []}, {}, {"prompt": "token_ids.ids"}),
    (
        {"token_ids": pb.TokenIds(ids=[2**31])},
        COMPLETIONS,
        {"prompt": [2**31]},
        {},
        {"prompt": "token_ids.ids"},
    ),
    ({"chat": pb.Chat()}, CHAT, {"messages": []}, {}, {"messages": "chat.messages"}),
    (
        {"chat": pb.Chat(messages=[pb.ChatMessage(role="robot", content="x")])},
        CHAT,
        {"messages": [{"role": "robot", "content": "x"}]},
        {},
        {"messages": "chat.messages"},
    ),
    (
        {"request_id": "bad id", "text": "x"},
        COMPLETIONS,
        {"prompt": "x"},
        {"X-Request-Id": "bad id"},
        {"X-Request-Id": "request_id"},
    ),
    ({}, None, None, {}, "prompt: one of text, chat or token_ids is required"),
    ({"text": "x", "min_p": 2.0}, COMPLETIONS, {"prompt": "x", "min_p": 2.0}, {}, {}),
    (
        {"text": "x", "presence_penalty": -3.0},
        COMPLETIONS,
        {"prompt": "x", "presence_penalty": -3.0},
        {},
        {},
    ),
    (
        {"text": "x", "repetition_penalty": 0.0},
        COMPLETIONS,
        {"prompt": "x", "repetition_penalty": 0.0},
        {},
        {},
    ),
    ({"text": "x", "min_tokens": 17}, COMPLETIONS, {"prompt": "x", "min_tokens": 17}, {}, {}),
    (
        {"text": "x", "logit_bias": {5: 101.0}},
        COMPLETIONS,
        {"prompt": "x", "logit_bias": {"5": 101.0}},
        {},
        {},
    ),
    ({"text": "x", "bad_words": [" "]}, COMPLETIONS, {"prompt": "x", "bad_words": [" "]}, {}, {}),
    ({"text": "x", "n": 0}, COMPLETIONS, {"prompt": "x", "n": 0}, {}, {}),
    ({"text": "x", "n": 17}, COMPLETIONS, {"prompt": "x", "n": 17}, {}, {}),
    ({"text": "x", "timeout": -1.0}, COMPLETIONS, {"prompt": "x", "timeout": -1.0}, {}, {}),
    # under --scheduling-policy fcfs (the default), as HTTP
    ({"text": "x", "priority": 2}, COMPLETIONS, {"prompt": "x", "priority": 2}, {}, {}),
    ({"text": "x", "logprobs": 21}, COMPLETIONS, {"prompt": "x", "logprobs": 21}, {}, {}),
    (
        {"chat": pb.Chat(messages=[pb.ChatMessage(role="user", content="hi")]), "logprobs": 21},
        CHAT,
        {"messages": [_USER], "logprobs": True, "top_logprobs": 21},
        {},
        {"top_logprobs": "logprobs"},
    ),
    (
        {"text": "x", "prompt_logprobs": -1},
        COMPLETIONS,
        {"prompt": "x", "prompt_logprobs": -1},
        {},
        {},
    ),
]


@pytest.mark.parametrize("fields,path,body,headers,renames", _BAD_INPUTS)
def test_bad_input_is_refused_as_http_refuses_it(
    fields: dict[str, Any],
    path: str | None,
    body: dict[str, Any] | None,
    headers: dict[str, str],
    renames: dict[str, str] | str,
) -> None:
    engine = FakeEngine()
    error = refusal(engine, **fields)
    assert error.code() == Code.INVALID_ARGUMENT
    if isinstance(renames, str):
        expected = renames
    else:
        assert path is not None
        http = run_http(engine, "POST", path, json=body, headers=headers)
        assert http.status_code == 400
        expected = http.json()["error"]["message"]
        for old, new in renames.items():
            expected = new + expected[len(old) :] if expected.startswith(old) else expected
    assert error.details() == expected
    assert not engine.requests


def test_unknown_model_and_not_ready() -> None:
    engine = FakeEngine()
    error = refusal(engine, text="x", model="nope")
    assert (error.code(), error.details()) == (
        Code.NOT_FOUND,
        "model: the model `nope` does not exist",
    )
    engine.ready = False
    error = refusal(engine, text="x")
    not_ready = "the engine is not ready yet; retry the request"
    assert (error.code(), error.details()) == (Code.UNAVAILABLE, not_ready)


def test_naming_the_model_while_starting_is_unavailable_not_unknown() -> None:
    engine = FakeEngine()
    engine.ready, engine.model_name = False, ""  # starting: no model served yet
    error = refusal(engine, text="x", model=MODEL)
    assert error.code() == Code.UNAVAILABLE and not engine.requests


def test_list_models_is_empty_while_starting_and_names_every_alias() -> None:
    engine = FakeEngine()
    engine.ready, engine.model_name = False, ""

    async def listed(channel: grpc.aio.Channel) -> list[str]:
        models = (await pb_grpc.ShuttleStub(channel).ListModels(pb.ListModelsRequest())).models
        return [m.id for m in models]

    assert run(engine, listed) == []
    engine.ready, engine.model_name, engine.aliases = True, MODEL, ["alias-1"]
    assert run(engine, listed) == [MODEL, "alias-1"]


def test_the_version_that_served_the_request_is_stamped() -> None:
    # the served version moved on (a swap) while this request ran on v-old
    finish = dataclasses.replace(delta("b", LENGTH), version="v-old")
    engine = FakeEngine([dataclasses.replace(delta("a"), version="v-old"), finish])
    engine.system_fingerprint = "v-new"
    out = run(engine, lambda ch: generate(ch, text="x"))
    assert out[-1].system_fingerprint == "v-old"


@pytest.mark.parametrize(
    "status,code",
    [
        (400, Code.INVALID_ARGUMENT),
        (404, Code.NOT_FOUND),
        (429, Code.RESOURCE_EXHAUSTED),
        (503, Code.UNAVAILABLE),
        (500, Code.INTERNAL),
    ],
)
def test_engine_failures_map_to_status_codes(status: int, code: grpc.StatusCode) -> None:
    engine = FakeEngine([delta("a"), RequestFailed(status, f"went wrong {status}")])
    error = refusal(engine, text="x")
    assert (error.code(), error.details()) == (code, f"went wrong {status}")


def test_engine_refusals_name_the_proto_field() -> None:
    failure = RequestFailed(400, "prompt: token id 99999 is outside the vocabulary", "prompt")
    error = refusal(FakeEngine([failure]), token_ids=pb.TokenIds(ids=[99999]))
    assert error.details() == "token_ids.ids: token id 99999 is outside the vocabulary"
    failure = RequestFailed(400, "prompt: the prompt has 300 tokens", "prompt")
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="hi")])
    error = refusal(FakeEngine([failure]), chat=chat)
    assert error.details() == "chat.messages: the prompt has 300 tokens"
    failure = RequestFailed(
        400, "X-Request-Id: request id 'r' is already in flight", "X-Request-Id"
    )
    error = refusal(FakeEngine([failure]), text="x", request_id="r")
    assert error.details() == "request_id: request id 'r' is already in flight"


def test_a_stream_ending_without_finish_is_internal() -> None:
    error = refusal(FakeEngine([delta("a")]), text="x")
    assert error.code() == Code.INTERNAL


# --- ending a call early ---------------------------------------------------------------------


def test_client_cancel_aborts_the_request() -> None:
    engine = FakeEngine([delta("a"), HANG])

    async def test(channel: grpc.aio.Channel) -> None:
        call = pb_grpc.ShuttleStub(channel).Generate(pb.GenerateRequest(request_id="c1", text="x"))
        assert (await call.read()).text == "a"
        call.cancel()
        await wait_until_async(lambda: engine.aborted == ["c1"], 30, "the abort of c1")

    run(engine, test)


def test_deadline_aborts_the_request() -> None:
    engine = FakeEngine([HANG])

    async def test(channel: grpc.aio.Channel) -> None:
        stub = pb_grpc.ShuttleStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate_with_timeout(stub, 0.3)
        assert info.value.code() == Code.DEADLINE_EXCEEDED
        await wait_until_async(lambda: engine.aborted == ["d1"], 30, "the abort of d1")

    run(engine, test)


async def generate_with_timeout(stub: pb_grpc.ShuttleStub, timeout: float) -> None:
    async for _ in stub.Generate(pb.GenerateRequest(request_id="d1", text="x"), timeout=timeout):
        pass


def test_cancel_rpc_and_list_models() -> None:
    engine = FakeEngine()

    async def test(channel: grpc.aio.Channel) -> None:
        stub = pb_grpc.ShuttleStub(channel)
        assert await stub.Cancel(pb.CancelRequest(request_id="r-9")) == pb.CancelResponse()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Cancel(pb.CancelRequest(request_id=""))
        assert info.value.code() == Code.INVALID_ARGUMENT
        assert info.value.details().startswith("request_id: ")
        models = (await stub.ListModels(pb.ListModelsRequest())).models
        assert [(m.id, m.max_model_len, m.version) for m in models] == [(MODEL, 256, "v-test")]

    run(engine, test)
    assert engine.aborted == ["r-9"]


# --- auth ------------------------------------------------------------------------------------


def _bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def test_api_key_guards_the_shuttle_service() -> None:
    async def test(channel: grpc.aio.Channel) -> None:
        stub = pb_grpc.ShuttleStub(channel)
        for metadata in ((), _bearer("wrong")):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ListModels(pb.ListModelsRequest(), metadata=metadata)
            assert info.value.code() == Code.UNAUTHENTICATED
        await stub.ListModels(pb.ListModelsRequest(), metadata=_bearer("k"))

    run(FakeEngine(), test, api_key="k")


def test_admin_wants_the_admin_token() -> None:
    engine = FakeEngine()

    async def test(channel: grpc.aio.Channel) -> None:
        admin = pb_grpc.AdminStub(channel)
        for metadata in ((), _bearer("wrong"), _bearer("k")):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await admin.CancelRequest(pb.AdminCancelRequest(request_id="a"), metadata=metadata)
            assert info.value.code() == Code.UNAUTHENTICATED
            assert "admin token" in info.value.details()
        await admin.CancelRequest(pb.AdminCancelRequest(request_id="a1"), metadata=_bearer(TOKEN))
        with pytest.raises(grpc.aio.AioRpcError) as info:  # a folder that is not a model
            await admin.SwapModel(pb.SwapModelRequest(model="/m"), metadata=_bearer(TOKEN))
        assert info.value.code() == Code.NOT_FOUND and "config.json" in info.value.details()

    run(engine, test, api_key="k", admin_token=TOKEN)
    assert engine.aborted == ["a1"]


def test_admin_is_closed_without_a_configured_token() -> None:
    async def test(channel: grpc.aio.Channel) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await pb_grpc.AdminStub(channel).ListRequests(
                pb.ListRequestsRequest(), metadata=_bearer("")
            )
        assert info.value.code() == Code.UNAUTHENTICATED
        assert "no admin token is configured" in info.value.details()

    run(FakeEngine(), test)


# --- health and reflection -------------------------------------------------------------------


def test_health_follows_engine_readiness() -> None:
    engine = FakeEngine()
    engine.ready = False

    async def status(stub: health_pb2_grpc.HealthStub, service: str) -> int:
        return (await stub.Check(health_pb2.HealthCheckRequest(service=service))).status

    async def test(channel: grpc.aio.Channel) -> None:
        stub = health_pb2_grpc.HealthStub(channel)
        serving, not_serving = (
            health_pb2.HealthCheckResponse.SERVING,
            health_pb2.HealthCheckResponse.NOT_SERVING,
        )
        for service in ("", "shuttle.v1.Shuttle", "shuttle.v1.Admin"):
            await eventually_status(stub, service, not_serving)
        engine.ready = True
        for service in ("", "shuttle.v1.Shuttle"):
            await eventually_status(stub, service, serving)
        engine.ready = False  # the worker went away
        await eventually_status(stub, "", not_serving)
        assert await status(stub, "shuttle.v1.Shuttle") == not_serving

    async def eventually_status(stub: health_pb2_grpc.HealthStub, service: str, want: int) -> None:
        async def reached() -> bool:
            return await status(stub, service) == want

        await wait_until_async(reached, 30, f"{service!r} to become {want}")

    run(engine, test)


def test_reflection_lists_the_services() -> None:
    async def test(channel: grpc.aio.Channel) -> list[str]:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        async for answer in stub.ServerReflectionInfo(iter([request])):
            return sorted(s.name for s in answer.list_services_response.service)
        return []

    assert run(FakeEngine(), test) == sorted(
        [
            "shuttle.v1.Shuttle",
            "shuttle.v1.Admin",
            "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection",
        ]
    )


def test_unused_port_conflict_fails_loudly() -> None:
    async def go() -> None:
        first = GrpcGateway(FakeEngine(), ServerConfig(grpc_port=0))
        port = await first.start()
        try:
            second = GrpcGateway(FakeEngine(), ServerConfig(grpc_port=port))
            with pytest.raises(RuntimeError, match="cannot serve gRPC"):
                await second.start()
        finally:
            await first.stop(grace=0)

    asyncio.run(go())


def test_length_finish_reason_number() -> None:
    out = run(FakeEngine([delta("a", LENGTH)]), lambda ch: generate(ch, text="x"))
    assert [r.finish_reason for r in out] == [pb.FINISH_REASON_LENGTH]


# --- n, priority, timeout, return_token_ids ---------------------------------------------------


def test_n_priority_and_timeout_convert_as_the_http_api_converts_them() -> None:
    engine = FakeEngine()
    fields: dict[str, Any] = dict(n=3, priority=-2, timeout=5.0, max_tokens=4)

    async def test(channel: grpc.aio.Channel) -> None:
        await generate(channel, text="a b", **fields)

    run(engine, test, policy="priority")
    body = {"prompt": "a b"} | fields
    resp = run_http(engine, "POST", COMPLETIONS, policy="priority", json=body)
    assert resp.status_code == 200
    from_grpc, from_http = engine.requests
    assert from_grpc.sampling == from_http.sampling and from_grpc.sampling.n == 3
    assert (from_grpc.priority, from_grpc.timeout) == (-2, 5.0)
    assert (from_http.priority, from_http.timeout) == (-2, 5.0)


def test_n_sequences_stream_with_their_index_until_every_one_finished() -> None:
    # sequence 1 finishes first; the stream goes on until sequence 0's, the request's last
    engine = FakeEngine(
        [
            delta("a", index=0),
            delta("b", index=1),
            delta("c", FinishReason.STOP, n=2, index=1, last=False),
            delta("d", n=2, index=0),
            delta("e", FinishReason.LENGTH, n=3, index=0, last=True),
        ]
    )
    out = run(engine, lambda ch: generate(ch, text="x", n=2))
    assert [(r.index, r.text) for r in out] == [(0, "a"), (1, "b"), (1, "c"), (0, "d"), (0, "e")]
    finished = {r.index: r for r in out if r.finish_reason}
    assert finished[1].finish_reason == pb.FINISH_REASON_STOP
    assert finished[0].finish_reason == pb.FINISH_REASON_LENGTH
    # each sequence's last message counts its own tokens
    assert (finished[1].usage.completion_tokens, finished[0].usage.completion_tokens) == (2, 3)
    assert finished[1].system_fingerprint == "v-test" and not engine.aborted


def test_return_token_ids_false_sends_text_only() -> None:
    engine = FakeEngine()

    async def test(channel: grpc.aio.Channel) -> tuple[list[Any], list[Any]]:
        plain = await generate(channel, text="a b", return_token_ids=False)
        explicit = await generate(channel, text="a b", return_token_ids=True)
        return plain, explicit

    plain, explicit = run(engine, test)
    assert [r.text for r in plain] == [" a", " b"]
    assert all(not r.token_ids for r in plain) and plain[-1].usage.completion_tokens == 2
    assert [list(r.token_ids) for r in explicit] == [[7], [7, 7]]


def test_priority_needs_the_priority_policy() -> None:
    error = refusal(FakeEngine(), text="x", priority=1)
    assert error.code() == Code.INVALID_ARGUMENT
    assert error.details().startswith("priority: needs --scheduling-policy priority")


def test_chat_template_kwargs_and_a_trusted_template_reach_the_engine() -> None:
    from google.protobuf.struct_pb2 import Struct

    engine = FakeEngine()
    kwargs = Struct()
    kwargs.update({"enable_thinking": False, "depth": 2})
    messages = [pb.ChatMessage(role="user", content="hi")]
    chat = pb.Chat(messages=messages, chat_template_kwargs=kwargs, chat_template="{{ x }}")

    async def test(channel: grpc.aio.Channel) -> None:
        await generate(channel, chat=chat)

    run(engine, test, trust_request_chat_template=True)
    (sent,) = engine.requests
    assert sent.chat_template_kwargs == {"enable_thinking": False, "depth": 2.0}
    assert sent.chat_template == "{{ x }}"
    error = refusal(FakeEngine(), chat=chat)  # without --trust-request-chat-template
    assert error.code() == Code.INVALID_ARGUMENT
    assert error.details().startswith("chat.chat_template: needs --trust-request-chat-template")
