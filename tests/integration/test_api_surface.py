"""The rest of the OpenAI and vLLM API surface on the real processes and the real small model:
batched prompts, /tokenize and /detokenize (answered by a tokenizer process), /ping and
/version, model aliases, refused fields, the context-length field, a body over the limit."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
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
