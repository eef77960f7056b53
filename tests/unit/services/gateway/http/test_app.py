"""The gateway's HTTP front end against a scripted fake engine, in process (no sockets)."""

from __future__ import annotations

import asyncio
import importlib.metadata
from typing import Any

import httpx
import pytest

from common.config import SchedulerConfig, ServerConfig
from common.messages import FinishReason
from services.gateway.engine.client import RequestFailed
from services.gateway.http.app import create_app
from services.gateway.http.deltas import usage_dict
from tests.fake_engine import HANG, MODEL, FakeEngine, delta
from tests.sse_events import parse_sse

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
STOP, LENGTH = FinishReason.STOP, FinishReason.LENGTH


def run(
    engine: FakeEngine,
    method: str,
    url: str,
    api_key: str | None = None,
    policy: str = "fcfs",
    trust_chat_template: bool = False,
    **kw: Any,
):
    async def go() -> httpx.Response:
        server = ServerConfig(
            api_key=api_key or "", trust_request_chat_template=trust_chat_template
        )
        scheduler = SchedulerConfig(scheduling_policy=policy)
        transport = httpx.ASGITransport(app=create_app(engine, server, scheduler))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, url, **kw)

    return asyncio.run(go())


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello big world"}]} | extra


def error_of(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["code"] == status
    return error


# --- happy paths -----------------------------------------------------------------------------


def test_chat_stream_framing() -> None:
    engine = FakeEngine()
    body = chat_body(stream=True, stream_options={"include_usage": True})
    resp = run(engine, "POST", CHAT, json=body)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    rid = resp.headers["x-request-id"]
    assert rid.startswith("chatcmpl-")
    events = parse_sse(resp.content)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["id"] == rid and c["object"] == "chat.completion.chunk" for c in chunks)
    assert all(c["model"] == MODEL and c["system_fingerprint"] == "v-test" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    texts = [c["choices"][0]["delta"]["content"] for c in chunks[1:4]]
    assert texts == [" hello", " big", " world"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:4])
    assert chunks[4]["choices"] == [
        {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    ]
    assert chunks[5]["choices"] == []
    assert chunks[5]["usage"] == usage_dict(5, 3, 0)
    assert len(chunks) == 6


def test_completion_stream_without_usage_and_client_request_id() -> None:
    engine = FakeEngine([delta("a"), delta(""), delta("b", LENGTH, 2)])
    resp = run(
        engine,
        "POST",
        COMPLETIONS,
        json={"prompt": "x", "stream": True},
        headers={"X-Request-Id": "my-id.1:2"},
    )
    assert resp.headers["x-request-id"] == "my-id.1:2"
    assert engine.requests[0].request_id == "my-id.1:2"
    events = parse_sse(resp.content)
    assert {e["id"] for e in events[:-1]} == {"cmpl-my-id.1:2"}  # vLLM's prefix on the body id
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["a", "b", ""]
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]] == [None, None, "length"]
    assert {e["object"] for e in events[:-1]} == {"text_completion"}
    assert events[-1] == "[DONE]"


def test_chat_non_streaming_shape_and_request_conversion() -> None:
    engine = FakeEngine()
    body = chat_body(
        temperature=0,
        top_p=0.5,
        top_k=-1,
        seed=3,
        stop="x",
        max_completion_tokens=9,
    )
    resp = run(engine, "POST", CHAT, json=body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["id"] == resp.headers["x-request-id"]
    assert out["object"] == "chat.completion"
    assert out["model"] == MODEL and out["system_fingerprint"] == "v-test"
    assert out["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": " hello big world"},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    assert out["usage"] == usage_dict(5, 3, 0)
    sampling = engine.requests[0].sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.0, 0.5, 0)
    assert (sampling.seed, sampling.stop, sampling.max_tokens) == (3, ["x"], 9)
    assert engine.requests[0].messages == [{"role": "user", "content": "hello big world"}]


def test_completion_non_streaming_defaults() -> None:
    engine = FakeEngine()
    resp = run(engine, "POST", COMPLETIONS, json={"prompt": ["one two"]})
    out = resp.json()
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-")
    assert out["choices"][0]["text"] == " one two"
    assert engine.requests[0].prompt == "one two"
    assert engine.requests[0].sampling.max_tokens == 16  # OpenAI's legacy default
    run(engine, "POST", COMPLETIONS, json={"prompt": [1, 2, 3], "stream": False})
    assert engine.requests[1].prompt_token_ids == [1, 2, 3]
    assert engine.requests[1].prompt is None
    run(engine, "POST", CHAT, json=chat_body())
    assert engine.requests[2].sampling.max_tokens == 0  # chat: as many as fit (tokenizer)


def test_models_and_health() -> None:
    engine = FakeEngine()
    models = run(engine, "GET", "/v1/models").json()
    assert models["object"] == "list"
    (card,) = models["data"]
    assert (card["id"], card["object"], card["owned_by"]) == (MODEL, "model", "shuttle")
    assert (card["max_model_len"], card["version"]) == (256, "v-test")
    assert run(engine, "GET", "/health").json() == {"status": "ok"}
    error = error_of(run(engine, "GET", "/v1/nothing-here"), 404)
    assert error["type"] == "NotFoundError"
    error_of(run(engine, "GET", CHAT), 405)
    engine.ready = False
    assert run(engine, "GET", "/health").status_code == 503
    error_of(run(engine, "POST", CHAT, json=chat_body()), 503)
    engine.model_name = ""  # starting: nothing is served yet, so no model is listed
    assert run(engine, "GET", "/v1/models").json() == {"object": "list", "data": []}


def test_ping_and_version() -> None:
    engine = FakeEngine()
    assert run(engine, "GET", "/ping").status_code == 200
    assert run(engine, "POST", "/ping").status_code == 200
    version = run(engine, "GET", "/version").json()["version"]
    assert version == importlib.metadata.version("shuttle")
    engine.ready = False  # as /health: not ready is 503
    assert run(engine, "GET", "/ping").status_code == 503


def test_openai_client_in_process() -> None:
    openai = pytest.importorskip("openai")
    # openai 3 speaks through httpx2, older releases through httpx: use the one it imports
    http_lib = getattr(openai._base_client, "httpx2", httpx)
    engine = FakeEngine()

    async def go() -> tuple[Any, list[Any]]:
        transport = http_lib.ASGITransport(app=create_app(engine, ServerConfig(api_key="k")))
        http = http_lib.AsyncClient(transport=transport)
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="k", http_client=http)
        messages = [{"role": "user", "content": "hi there"}]
        full = await client.chat.completions.create(model=MODEL, messages=messages)
        stream = await client.chat.completions.create(model=MODEL, messages=messages, stream=True)
        return full, [c async for c in stream]

    full, chunks = asyncio.run(go())
    assert full.choices[0].message.content == " hi there"
    assert full.usage.total_tokens == 7
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == " hi there"
    assert chunks[-1].choices[0].finish_reason == "stop"


# --- n > 1: several choices per request ---------------------------------------------------------

# two sequences interleaved; #1 finishes first, #0's finish is the request's last delta
TWO = [
    delta("x", index=1),
    delta("a", index=0),
    delta("y", LENGTH, 2, index=1, last=False),
    delta("b", STOP, 2, index=0, last=True),
]


def test_n_non_streaming_choices_by_index_and_summed_usage() -> None:
    for url, body in ((CHAT, chat_body(n=2)), (COMPLETIONS, {"prompt": "p", "n": 2})):
        resp = run(FakeEngine(TWO), "POST", url, json=body | {"return_token_ids": True})
        out = resp.json()
        key = "message" if url == CHAT else "text"
        texts = [c[key] for c in out["choices"]]
        if url == CHAT:
            texts = [m["content"] for m in texts]
        assert [c["index"] for c in out["choices"]] == [0, 1]
        assert texts == ["ab", "xy"]
        assert [c["finish_reason"] for c in out["choices"]] == ["stop", "length"]
        assert [c["token_ids"] for c in out["choices"]] == [[7] * 3] * 2
        assert out["usage"] == usage_dict(5, 4, 0)


def test_n_chat_stream_one_choice_per_chunk() -> None:
    body = chat_body(n=2, stream=True, stream_options={"include_usage": True})
    events = parse_sse(run(FakeEngine(TWO), "POST", CHAT, json=body).content)
    assert events[-1] == "[DONE]"
    choices = [
        (c["index"], c["delta"], c["finish_reason"]) for e in events[:-2] for c in e["choices"]
    ]
    assert all(len(e["choices"]) == 1 for e in events[:-2])
    role = {"role": "assistant", "content": ""}
    assert choices == [
        (0, role, None),
        (1, role, None),
        (1, {"content": "x"}, None),
        (0, {"content": "a"}, None),
        (1, {"content": "y"}, None),
        (1, {}, "length"),
        (0, {"content": "b"}, None),
        (0, {}, "stop"),
    ]
    assert events[-2]["choices"] == []
    assert events[-2]["usage"] == usage_dict(5, 4, 0)


def test_n_completion_stream_ends_on_the_last_sequence() -> None:
    engine = FakeEngine([*TWO[:3], 0.01, TWO[3]])
    events = parse_sse(
        run(engine, "POST", COMPLETIONS, json={"prompt": "p", "n": 2, "stream": True}).content
    )
    choices = [
        (c["index"], c["text"], c["finish_reason"]) for e in events[:-1] for c in e["choices"]
    ]
    assert choices == [
        (1, "x", None),
        (0, "a", None),
        (1, "y", None),
        (1, "", "length"),
        (0, "b", None),
        (0, "", "stop"),
    ]
    assert events[-1] == "[DONE]" and engine.aborted == []


def test_n_priority_timeout_reach_the_engine() -> None:
    engine = FakeEngine(TWO)
    body = {"prompt": "p", "n": 2, "best_of": 2, "priority": -3, "timeout": 1.5}
    assert run(engine, "POST", COMPLETIONS, policy="priority", json=body).status_code == 200
    engine.script = None  # the echo, for the n = 1 requests below
    run(engine, "POST", CHAT, json=chat_body(n=None, priority=None, timeout=None))
    run(engine, "POST", CHAT, policy="priority", json=chat_body(n=1, priority=7, timeout=2))
    got = [(r.sampling.n, r.priority, r.timeout) for r in engine.requests]
    assert got == [(2, -3, 1.5), (1, 0, None), (1, 7, 2.0)]


# --- a batch of prompts ----------------------------------------------------------------------


def _batch_engine(request_ids: list[str], hang: bool = False) -> FakeEngine:
    """Each prompt k's request: two sequences, 'p<k>s<i>', sequence 1's delta first (or,
    with `hang`, the last prompt's request never answers)."""
    engine = FakeEngine()
    for k, request_id in enumerate(request_ids):
        engine.scripts[request_id] = [
            delta(f"p{k}s1", LENGTH, 2, index=1, last=False),
            delta(f"p{k}s0", STOP, 1, index=0, last=True),
        ]
    if hang:
        engine.scripts[request_ids[-1]] = [HANG]
    return engine


@pytest.mark.parametrize(
    "prompts", [["one", "two", "three"], [[1, 2], [3], [4, 5, 6]]], ids=["texts", "token-ids"]
)
def test_a_batch_of_prompts_answers_prompt_major(prompts: list[Any]) -> None:
    engine = _batch_engine(["b-0", "b-1", "b-2"])
    body = {"prompt": prompts, "n": 2, "return_token_ids": True}
    resp = run(engine, "POST", COMPLETIONS, json=body, headers={"X-Request-Id": "b"})
    out = resp.json()
    assert [r.request_id for r in engine.requests] == ["b-0", "b-1", "b-2"]
    if isinstance(prompts[0], str):
        assert [r.prompt for r in engine.requests] == prompts
    else:
        assert [r.prompt_token_ids for r in engine.requests] == prompts
    assert [r.sampling.n for r in engine.requests] == [2, 2, 2]  # n per prompt
    got = [(c["index"], c["text"], c["finish_reason"]) for c in out["choices"]]
    assert got == [
        (0, "p0s0", "stop"),
        (1, "p0s1", "length"),
        (2, "p1s0", "stop"),
        (3, "p1s1", "length"),
        (4, "p2s0", "stop"),
        (5, "p2s1", "length"),
    ]
    # each prompt's 5 tokens once; 1 + 2 output tokens per prompt
    assert out["usage"] == usage_dict(15, 9, 0)
    assert out["id"] == "cmpl-b" and not engine.aborted


def test_a_streamed_batch_ends_after_every_prompt() -> None:
    body = {"prompt": ["a", "b"], "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    engine = _batch_engine(["s-0", "s-1"])
    resp = run(engine, "POST", COMPLETIONS, json=body, headers={"X-Request-Id": "s"})
    events = parse_sse(resp.content)
    assert events[-1] == "[DONE]"
    texts = {c["index"]: c["text"] for e in events[:-2] for c in e["choices"] if c["text"]}
    assert texts == {0: "p0s0", 1: "p0s1", 2: "p1s0", 3: "p1s1"}
    finishes = sorted(
        (c["index"], c["finish_reason"])
        for e in events[:-2]
        for c in e["choices"]
        if c["finish_reason"]
    )
    assert finishes == [(0, "stop"), (1, "length"), (2, "stop"), (3, "length")]
    assert events[-2]["usage"] == usage_dict(10, 6, 0)


def test_a_failed_prompt_fails_the_batch_and_ends_the_others() -> None:
    engine = _batch_engine(["f-0", "f-1", "f-2"], hang=True)
    engine.scripts["f-0"] = [delta("a"), HANG]
    engine.scripts["f-1"] = [RequestFailed(400, "prompt: the prompt has 300 tokens", "prompt")]
    body = {"prompt": ["a", "b", "c"]}
    resp = run(engine, "POST", COMPLETIONS, json=body, headers={"X-Request-Id": "f"})
    error = error_of(resp, 400)
    assert (error["param"], error["message"]) == (
        "prompt[1]",
        "prompt[1]: the prompt has 300 tokens",
    )
    assert sorted(engine.aborted) == ["f-0", "f-2"]  # those still running


def test_a_client_leaving_a_batch_aborts_every_prompt() -> None:
    engine = FakeEngine([HANG])
    body = b'{"prompt": ["a", "b", "c"]}'
    aborted = ("gone-1-0", "gone-1-1", "gone-1-2")
    sent = asyncio.run(_call_then_leave(engine, body, "2.3", "receive", COMPLETIONS, aborted))
    assert sent[0]["status"] == 499


def test_sampling_controls_reach_the_engine() -> None:
    engine = FakeEngine()
    body = chat_body(
        presence_penalty=0.5,
        frequency_penalty=-1,
        repetition_penalty=1.3,
        min_p=0.05,
        min_tokens=3,
        max_tokens=8,
        logit_bias={"17": 5, "3": -100},
        bad_words=["foo", " bar baz"],
        temperature=0.7,
    )
    assert run(engine, "POST", CHAT, json=body).status_code == 200
    got = engine.requests[0].sampling
    assert (got.presence_penalty, got.frequency_penalty, got.repetition_penalty) == (
        0.5,
        -1.0,
        1.3,
    )
    assert (got.min_p, got.min_tokens, got.max_tokens) == (0.05, 3, 8)
    assert dict(zip(got.logit_bias_token_ids, got.logit_bias_values, strict=True)) == {
        17: 5.0,
        3: -100.0,
    }
    assert got.bad_words == ["foo", " bar baz"]
    assert got.bad_words_token_ids == []  # the tokenizer fills them
    assert got.has_controls
    # the fields a model's generation_config may fill: those the client left unset
    assert engine.requests[0].unset_sampling == ["top_p", "top_k"]


def test_unset_sampling_fields_default_and_are_named() -> None:
    engine = FakeEngine()
    run(engine, "POST", COMPLETIONS, json={"prompt": "p"})
    run(engine, "POST", COMPLETIONS, json={"prompt": "p", "top_k": -1, "min_p": None})
    plain, explicit = engine.requests
    assert plain.unset_sampling == [
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
    ]
    assert explicit.unset_sampling == ["temperature", "top_p", "min_p", "repetition_penalty"]
    sp = plain.sampling
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.repetition_penalty) == (
        1.0,
        1.0,
        0,
        0.0,
        1.0,
    )
    assert not sp.has_controls and sp.logit_bias_token_ids == [] and sp.bad_words == []


# --- refusals --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"model": MODEL}, "messages", "required"),
        (chat_body(messages=[]), "messages", "at least 1"),
        (chat_body(messages="hi"), "messages", "list"),
        (chat_body(messages=[{"role": "bot", "content": "x"}]), "messages[0].role", "one of"),
        (chat_body(messages=[{"role": "user", "content": 3}]), "messages[0].content", "string"),
        (chat_body(max_tokens=0), "max_tokens", ">= 1"),
        (chat_body(max_tokens="5"), "max_tokens", "integer"),
        (chat_body(max_tokens=True), "max_tokens", "integer"),
        (chat_body(max_tokens=10_000), "max_tokens", "<= 256"),
        (chat_body(temperature=-0.1), "temperature", ">= 0"),
        (chat_body(temperature=2.5), "temperature", "<= 2"),
        (chat_body(top_p=0), "top_p", "> 0"),
        (chat_body(top_p=1.01), "top_p", "<= 1"),
        (chat_body(n=17), "n", "<= 16"),
        (chat_body(n=0), "n", ">= 1"),
        (chat_body(n=2.0), "n", "integer"),
        ({"prompt": "x", "n": 3, "best_of": 2}, "best_of", "must be >= n (3)"),
        ({"prompt": "x", "best_of": 2, "stream": True}, "best_of", "cannot be streamed"),
        (chat_body(priority="1"), "priority", "integer"),
        (chat_body(priority=1.5), "priority", "integer"),
        (chat_body(timeout=0), "timeout", "> 0"),
        (chat_body(timeout=86401), "timeout", "<= 86400"),
        (chat_body(timeout="5"), "timeout", "number"),
        (chat_body(timeout=True), "timeout", "number"),
        (chat_body(stream="yes"), "stream", "boolean"),
        (chat_body(stop=["a", ""]), "stop", "1..256"),
        (chat_body(stop=["s"] * 65), "stop", "at most 64"),
        (chat_body(presence_penalty=2.5), "presence_penalty", "<= 2"),
        (chat_body(frequency_penalty=-2.1), "frequency_penalty", ">= -2"),
        (chat_body(frequency_penalty="1"), "frequency_penalty", "number"),
        (chat_body(repetition_penalty=0), "repetition_penalty", "> 0"),
        (chat_body(min_p=1.5), "min_p", "<= 1"),
        (chat_body(min_p=-0.1), "min_p", ">= 0"),
        (chat_body(min_tokens=-1), "min_tokens", ">= 0"),
        (chat_body(min_tokens=1.5), "min_tokens", "integer"),
        (chat_body(max_tokens=10, min_tokens=11), "min_tokens", "<= max_tokens (10)"),
        ({"prompt": "x", "min_tokens": 17}, "min_tokens", "<= max_tokens (16)"),
        (chat_body(logit_bias={"5": 100.5}), "logit_bias.5", "<= 100"),
        (chat_body(logit_bias={"5": -101}), "logit_bias.5", ">= -100"),
        (chat_body(logit_bias={"five": 1}), "logit_bias", "token ids"),
        (chat_body(logit_bias={"-5": 1}), "logit_bias", "token ids"),
        (chat_body(logit_bias={"5": 1, "05": 1}), "logit_bias", "token ids"),
        (chat_body(logit_bias=[5]), "logit_bias", "object"),
        (chat_body(bad_words="word"), "bad_words", "list"),
        (chat_body(bad_words=["ok", "  "]), "bad_words", "not all spaces"),
        (chat_body(bad_words=["w"] * 65), "bad_words", "at most 64"),
        (chat_body(top_logprobs=2), "top_logprobs", "needs logprobs: true"),
        (chat_body(logprobs=True, top_logprobs=21), "top_logprobs", "<= 20"),
        ({"prompt": "x", "logprobs": 21}, "logprobs", "<= 20"),
        ({"prompt": "x", "logprobs": True}, "logprobs", "integer"),
        ({"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs", ">= 0"),
        ({"prompt": ""}, "prompt", "empty"),
        ({"prompt": ["a", ""]}, "prompt", "prompt 1 must not be empty"),
        ({"prompt": [[1, 2], [3, -1]]}, "prompt", "prompt 1 token ids must be integers"),
        ({"prompt": [[1], "a", 3]}, "prompt", "prompt 2 must be a string or a list of token"),
        ({"prompt": []}, "prompt", "empty"),
        ({"prompt": ["a"] * 65}, "prompt", "at most 64 prompts"),
        ({"prompt": [1, -2]}, "prompt", "token ids"),
        ({"prompt": "x", "suffix": "y"}, "suffix", "not supported"),
    ],
)
def test_invalid_fields_are_400_naming_the_field(
    body: dict[str, Any], field: str, words: str
) -> None:
    url = COMPLETIONS if "prompt" in body else CHAT
    engine = FakeEngine()
    error = error_of(run(engine, "POST", url, json=body), 400)
    assert error["param"] == field
    assert error["message"].startswith(f"{field}: ")
    assert words in error["message"]
    assert error["type"] == "BadRequestError"
    assert engine.requests == []  # nothing unvalidated reaches the engine


def test_nan_is_refused() -> None:
    content = b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}'
    error = error_of(run(FakeEngine(), "POST", CHAT, content=content), 400)
    assert error["param"] == "temperature" and "finite" in error["message"]


@pytest.mark.parametrize("content", [b"{not json", b"", b"[1, 2]"])
def test_malformed_body_is_400_naming_the_body(content: bytes) -> None:
    error = error_of(run(FakeEngine(), "POST", CHAT, content=content), 400)
    assert error["message"].startswith("body: ")


@pytest.mark.parametrize("request_id", ["", "a b", "x" * 129, "é"])
def test_bad_request_id_header(request_id: str) -> None:
    headers = {"X-Request-Id": request_id.encode()}
    error = error_of(run(FakeEngine(), "POST", CHAT, json=chat_body(), headers=headers), 400)
    assert error["param"] == "X-Request-Id" and "128" in error["message"]


def test_unknown_model_is_404() -> None:
    resp = run(FakeEngine(), "POST", CHAT, json=chat_body(model="gpt-9"))
    error = error_of(resp, 404)
    assert error["param"] == "model" and "gpt-9" in error["message"]
    assert error["type"] == "NotFoundError"
    assert resp.headers["x-request-id"].startswith("chatcmpl-")


def test_naming_the_model_while_starting_is_a_retryable_503() -> None:
    engine = FakeEngine()
    engine.ready, engine.model_name = False, ""  # starting: no model served yet
    for url, body in ((CHAT, chat_body()), (COMPLETIONS, {"model": MODEL, "prompt": "x"})):
        resp = run(engine, "POST", url, json=body)
        error_of(resp, 503)
        assert resp.headers["retry-after"] == "1"
    assert engine.requests == []


def test_aliases_are_listed_and_accepted() -> None:
    engine = FakeEngine()
    engine.aliases = ["alias-1", "alias-2"]
    cards = run(engine, "GET", "/v1/models").json()["data"]
    assert [c["id"] for c in cards] == [MODEL, "alias-1", "alias-2"]
    assert {c["root"] for c in cards} == {MODEL}
    out = run(engine, "POST", CHAT, json=chat_body(model="alias-2")).json()
    assert out["model"] == MODEL  # the first name is the one reported
    error_of(run(engine, "POST", CHAT, json=chat_body(model="alias-3")), 404)


def test_client_request_ids_get_the_vllm_prefix_in_the_body() -> None:
    headers = {"X-Request-Id": "abc"}
    out = run(FakeEngine(), "POST", CHAT, json=chat_body(), headers=headers).json()
    assert out["id"] == "chatcmpl-abc"
    out = run(FakeEngine(), "POST", COMPLETIONS, json={"prompt": "x"}, headers=headers).json()
    assert out["id"] == "cmpl-abc"
    headers = {"X-Request-Id": "chatcmpl-mine"}  # already prefixed: kept as it is
    assert run(FakeEngine(), "POST", CHAT, json=chat_body(), headers=headers).json()["id"] == (
        "chatcmpl-mine"
    )


def test_api_key() -> None:
    engine = FakeEngine()
    error = error_of(run(engine, "POST", CHAT, api_key="s3cret", json=chat_body()), 401)
    assert "API key" in error["message"]
    resp = run(
        engine, "POST", CHAT, api_key="s3cret", json=chat_body(), headers={"X-Request-Id": "r-401"}
    )
    error_of(resp, 401)
    assert resp.headers["x-request-id"] == "r-401"  # refusals echo the client's id too
    wrong = {"Authorization": "Bearer nope"}
    error_of(run(engine, "GET", "/v1/models", api_key="s3cret", headers=wrong), 401)
    good = {"Authorization": "Bearer s3cret"}
    assert run(engine, "GET", "/v1/models", api_key="s3cret", headers=good).status_code == 200
    assert run(engine, "GET", "/health", api_key="s3cret").status_code == 200


# --- engine failures ---------------------------------------------------------------------------


@pytest.mark.parametrize(("status", "retry"), [(429, "1"), (503, "1"), (400, None)])
def test_failure_before_first_delta_is_an_http_status(status: int, retry: str | None) -> None:
    for stream in (True, False):
        engine = FakeEngine([RequestFailed(status, "stop: too long", "stop")])
        resp = run(engine, "POST", CHAT, json=chat_body(stream=stream))
        error = error_of(resp, status)
        assert error["message"] == "stop: too long" and error["param"] == "stop"
        assert resp.headers.get("retry-after") == retry
        assert resp.headers["x-request-id"] == engine.requests[0].request_id


@pytest.mark.parametrize(("url", "field"), [(CHAT, "messages"), (COMPLETIONS, "prompt")])
def test_a_prompt_too_long_names_the_endpoints_prompt_field(url: str, field: str) -> None:
    # the tokenizer and the scheduler call any request's prompt `prompt`
    too_long = "prompt: the prompt has 300 tokens; this server holds at most 255"
    body = chat_body() if url == CHAT else {"prompt": "x"}
    for stream in (False, True):
        engine = FakeEngine([RequestFailed(400, too_long, "prompt")])
        error = error_of(run(engine, "POST", url, json=body | {"stream": stream}), 400)
        assert error["param"] == field
        assert (
            error["message"] == f"{field}: the prompt has 300 tokens; this server holds at most 255"
        )


def test_failure_mid_stream_is_an_error_event_then_done() -> None:
    engine = FakeEngine([delta("a"), RequestFailed(503, "worker died")])
    resp = run(engine, "POST", CHAT, json=chat_body(stream=True))
    assert resp.status_code == 200
    events = parse_sse(resp.content)
    assert events[1]["choices"][0]["delta"] == {"content": "a"}
    assert events[2] == {
        "error": {
            "message": "worker died",
            "type": "ServiceUnavailableError",
            "param": None,
            "code": 503,
        }
    }
    assert events[3:] == ["[DONE]"]


# --- disconnects -------------------------------------------------------------------------------


def _scope(path: str, spec_version: str) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": spec_version},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"test"),
            (b"content-type", b"application/json"),
            (b"x-request-id", b"gone-1"),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("test", 80),
    }


async def _call_then_leave(
    engine: FakeEngine,
    body: bytes,
    spec: str,
    leave: str,
    path: str = CHAT,
    aborted: tuple[str, ...] = ("gone-1",),
) -> list[Any]:
    """Call the app directly, as a server would; the client leaves once the engine started
    and, for a stream, the first chunk went out: by a disconnect message (`leave` "receive")
    or by send() raising (`leave` "send", what ASGI 2.4 servers do)."""
    app, sent, first_chunk = create_app(engine), [], asyncio.Event()
    is_stream = b'"stream": true' in body
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await engine.started.wait()
        if is_stream:
            await first_chunk.wait()
        if leave == "send":
            await asyncio.Event().wait()  # a 2.4 server never says
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            if leave == "send" and first_chunk.is_set():
                raise OSError("connection reset by peer")
            first_chunk.set()
        sent.append(message)

    await asyncio.wait_for(app(_scope(path, spec), receive, send), 5)
    # checked before asyncio.run ends, whose clean-up would close a forgotten generator
    assert sorted(engine.aborted) == list(aborted)
    return sent


@pytest.mark.parametrize(("spec", "leave"), [("2.3", "receive"), ("2.4", "send")])
def test_stream_disconnect_aborts_in_engine(spec: str, leave: str) -> None:
    engine = FakeEngine([delta("a"), delta("b"), HANG])
    body = b'{"messages": [{"role": "user", "content": "x"}], "stream": true}'
    sent = asyncio.run(_call_then_leave(engine, body, spec, leave))
    assert engine.aborted == ["gone-1"]
    assert sent[0]["status"] == 200


def test_non_streaming_disconnect_aborts_in_engine() -> None:
    engine = FakeEngine([delta("a"), HANG])
    body = b'{"messages": [{"role": "user", "content": "x"}]}'
    sent = asyncio.run(_call_then_leave(engine, body, "2.3", "receive"))
    assert engine.aborted == ["gone-1"]
    assert sent[0]["status"] == 499


def test_disconnect_while_waiting_for_first_delta_aborts() -> None:
    engine = FakeEngine([HANG])
    body = b'{"messages": [{"role": "user", "content": "x"}], "stream": false}'
    sent = asyncio.run(_call_then_leave(engine, body, "2.3", "receive"))
    assert engine.aborted == ["gone-1"] and sent[0]["status"] == 499


def test_finished_request_is_not_aborted() -> None:
    engine = FakeEngine()
    run(engine, "POST", CHAT, json=chat_body(stream=True))
    run(engine, "POST", CHAT, json=chat_body())
    assert len(engine.requests) == 2 and engine.aborted == []
