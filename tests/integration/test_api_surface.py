"""The rest of the OpenAI and vLLM API surface on the real processes and the real small model:
batched prompts, /tokenize and /detokenize (answered by a tokenizer process), /ping and
/version, model aliases, refused fields, the context-length field, a body over the limit."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.server import Server, running_server

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS = ["1, 2, 3, 4,", "The capital of France is"]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    flags = ("--served-model-name", "smol", "smol-alias", "--num-tokenizers", "2")
    with running_server(*flags) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", timeout=120, max_retries=0)


def test_aliases_ping_and_version(server: Server, client: openai.OpenAI) -> None:
    assert server.model == "smol"  # the first name is the one reported
    assert [m.id for m in client.models.list().data] == ["smol", "smol-alias"]
    out = client.completions.create(model="smol-alias", prompt="Hi", max_tokens=2)
    assert out.model == "smol" and out.id.startswith("cmpl-")
    assert httpx.get(server.url + "/ping", timeout=30).status_code == 200
    assert httpx.get(server.url + "/version", timeout=30).json()["version"]


def test_a_batch_of_prompts_is_answered_prompt_major(client: openai.OpenAI) -> None:
    args = {"model": "smol", "max_tokens": 6, "temperature": 0.0}
    alone = [client.completions.create(prompt=p, **args) for p in PROMPTS]
    batch = client.completions.create(prompt=PROMPTS, n=2, **args)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    texts = [c.text for c in batch.choices]
    assert texts == [alone[0].choices[0].text] * 2 + [alone[1].choices[0].text] * 2  # greedy
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)


def test_a_batch_of_token_id_prompts_streams(server: Server) -> None:
    tokenize = httpx.post(server.url + "/tokenize", json={"prompt": PROMPTS[0]}, timeout=60)
    ids = tokenize.json()["tokens"]
    body = {"prompt": [ids, ids[:3]], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert '"index":1' in "".join(lines) and '"index":2' not in "".join(lines)


def test_tokenize_matches_what_generation_counts(server: Server, client: openai.OpenAI) -> None:
    http = server.client()
    out = http.post("/tokenize", json={"model": "smol", "prompt": PROMPTS[1]}).json()
    comp = client.completions.create(model="smol", prompt=PROMPTS[1], max_tokens=1)
    assert out["count"] == len(out["tokens"]) == comp.usage.prompt_tokens
    assert out["max_model_len"] == 8192
    chat = http.post("/tokenize", json={"messages": CHAT}).json()
    answer = client.chat.completions.create(model="smol", messages=CHAT, max_tokens=1)
    assert chat["count"] == answer.usage.prompt_tokens
    plain = http.post("/tokenize", json={"prompt": PROMPTS[1], "add_special_tokens": False})
    text = http.post("/detokenize", json={"tokens": plain.json()["tokens"]}).json()["prompt"]
    assert text == PROMPTS[1]
    refused = http.post("/detokenize", json={"tokens": [10**7]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tokens"


def test_a_prompt_too_long_names_the_endpoints_field(server: Server) -> None:
    long_text = "hello " * 9000  # > 8192 tokens
    http = server.client()
    chat = http.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": long_text}]}
    )
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
    comp = http.post("/v1/completions", json={"prompt": long_text, "max_tokens": 4})
    assert comp.status_code == 400 and comp.json()["error"]["param"] == "prompt"


def test_unsupported_fields_are_refused_by_name(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:  # one structured-output backend
        client.chat.completions.create(
            model="smol", messages=CHAT, extra_body={"guided_decoding_backend": "outlines"}
        )
    assert info.value.body["param"] == "guided_decoding_backend"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as info:  # honoured, within the vocabulary
        client.chat.completions.create(model="smol", messages=CHAT, logit_bias={"999999": 10})
    assert info.value.body["param"] == "logit_bias"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="smol", prompt="x", extra_body={"priority": 3})  # fcfs
    assert info.value.body["param"] == "priority"  # type: ignore[index]


def test_a_body_over_the_limit_is_a_413_the_client_reads(client: openai.OpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as info:  # default --max-request-bytes: 4 MiB
        client.completions.create(model="smol", prompt="x" * (10 * 1024 * 1024), max_tokens=1)
    assert info.value.status_code == 413


def _complete(server: Server, **body: Any) -> dict[str, Any]:
    greedy = {"model": "smol", "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    r = httpx.post(server.url + "/v1/completions", json=greedy | body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_min_tokens_holds_stop_strings(server: Server) -> None:
    """As vLLM: a stop string ends the output only if it ends in the text of a token after
    the first min_tokens ones (EOS is ignored here, so every run samples the same tokens)."""
    full = _complete(server, prompt=PROMPTS[0], max_tokens=16)
    text, ids = full["text"], full["token_ids"]
    assert text.count(",") >= 3, text  # " 5, 6, 7, 8, ..."
    plain = _complete(server, prompt=PROMPTS[0], max_tokens=16, stop=[","])
    assert plain["text"] == text[: text.index(",")] and plain["finish_reason"] == "stop"
    min_tokens = 4
    detok = httpx.post(server.url + "/detokenize", json={"tokens": ids[:min_tokens]}, timeout=60)
    floor = len(detok.json()["prompt"])  # the text of the first min_tokens tokens
    assert text[:floor] == detok.json()["prompt"] and "," in text[:floor]
    held = _complete(server, prompt=PROMPTS[0], max_tokens=16, stop=[","], min_tokens=min_tokens)
    assert held["text"] == text[: text.index(",", floor)] and held["finish_reason"] == "stop"
    assert len(held["token_ids"]) > min_tokens


def _sse_chunks(server: Server, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", server.url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [orjson.loads(line) for line in lines[:-1]]


def _same_prompt_logprobs(got: list[Any], want: list[Any]) -> None:
    assert got[0] is None and want[0] is None and len(got) == len(want) > 1
    for a, b in zip(got[1:], want[1:], strict=True):
        assert a.keys() == b.keys()
        for token_id, entry in a.items():
            assert abs(entry["logprob"] - b[token_id]["logprob"]) < 1e-4
            assert entry["rank"] == b[token_id]["rank"]


def test_streamed_prompt_logprobs_come_in_the_first_chunk(server: Server) -> None:
    body = {"model": "smol", "prompt": PROMPTS[1], "max_tokens": 3, "prompt_logprobs": 2}
    answer = _complete(server, **body)
    chunks = _sse_chunks(server, "/v1/completions", body | {"stream": True})
    carrying = [c["choices"][0] for c in chunks if "prompt_logprobs" in c["choices"][0]]
    assert carrying and carrying[0] is chunks[0]["choices"][0] and len(carrying) == 1
    _same_prompt_logprobs(carrying[0]["prompt_logprobs"], answer["prompt_logprobs"])
    # every prompt token's rank, also outside the top 2 (vLLM's; was null there)
    chosen = [next(iter(e.values())) for e in answer["prompt_logprobs"][1:]]
    assert all(isinstance(c["rank"], int) and c["rank"] >= 1 for c in chosen)
    assert any(c["rank"] > 2 for c in chosen)  # a prompt is rarely the model's top choices
    chat = {"model": "smol", "messages": CHAT, "max_tokens": 3, "prompt_logprobs": 1}
    r = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=120)
    chunks = _sse_chunks(server, "/v1/chat/completions", chat | {"stream": True})
    (carrying_chunk,) = [c for c in chunks if "prompt_logprobs" in c]
    _same_prompt_logprobs(carrying_chunk["prompt_logprobs"], r.json()["prompt_logprobs"])


def test_cached_tokens_count_the_prompt_served_by_the_prefix_cache(client: openai.OpenAI) -> None:
    """usage.prompt_tokens_details.cached_tokens (input_tokens_details in the Responses API):
    0 on a prompt's first sight, whole blocks of it when the same prompt comes again, in a
    completions answer and stream's usage chunk, the chat answer and a response."""
    text = f"{uuid.uuid4().hex}: a tale of ships and harbours, told slowly: " + " ".join(
        f"the {w} sailed at dawn and came home at dusk;" for w in ("Ada", "Brig", "Cora", "Dove")
    )
    first = client.completions.create(model="smol", prompt=text, max_tokens=2)
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # (no block of it seen yet)
    stream = client.completions.create(
        model="smol",
        prompt=text,
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [c.usage for c in stream if c.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens_details is not None
    cached = usage[0].prompt_tokens_details.cached_tokens
    assert cached is not None and 16 <= cached < usage[0].prompt_tokens and cached % 16 == 0

    chat = [{"role": "user", "content": text}]
    once = client.chat.completions.create(model="smol", messages=chat, max_tokens=2)
    again = client.chat.completions.create(model="smol", messages=chat, max_tokens=2)
    assert once.usage is not None and again.usage is not None
    assert once.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details is not None
    before = once.usage.prompt_tokens_details.cached_tokens or 0  # (the template's own start)
    cached = again.usage.prompt_tokens_details.cached_tokens or 0
    assert before < cached < again.usage.prompt_tokens and cached % 16 == 0

    response = client.responses.create(model="smol", input=text, max_output_tokens=2)
    assert response.usage is not None
    assert response.usage.input_tokens_details.cached_tokens > 0
