"""Issue 24's strict fields and small fixes on the real processes and the real small model,
over the `openai` client: a server started in vLLM's positional form (`shuttle serve
MODEL`), unknown fields refused with the name meant, GET /v1/models/{id}, an assistant
tool_calls turn with no content key, continuous usage in a stream, detokenize: false, and
the access log's lines."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from common.prepare_model import prepare_default_model
from tests.server import Server, running_server
from tests.waiting import wait_until

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    model = str(prepare_default_model())
    with running_server(model, "--served-model-name", "smol") as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", timeout=120, max_retries=0)


def test_served_from_the_positional_model(server: Server, client: openai.OpenAI) -> None:
    assert server.model == "smol"
    card = client.models.retrieve("smol")
    assert card.id == "smol" and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_misspelled_fields_are_refused_with_the_name_meant(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="smol", messages=CHAT, extra_body={"max_token": 5, "temprature": 0}
        )
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == "max_token"
    assert "did you mean `max_tokens`" in body["message"]
    assert "temprature; did you mean `temperature`" in body["message"]


def test_a_tool_call_turn_without_content(client: openai.OpenAI) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        *CHAT,
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "Paris"},
    ]
    out = client.chat.completions.create(
        model="smol",
        messages=messages,
        max_tokens=4,
        temperature=0,  # type: ignore[arg-type]
    )
    assert out.usage is not None and out.usage.completion_tokens >= 1


def test_continuous_usage_and_detokenize_false(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model="smol",
        prompt="1, 2, 3,",
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
    )
    chunks = list(stream)
    counts = [c.usage.completion_tokens for c in chunks if c.usage is not None]
    assert len(counts) == len(chunks) and counts == sorted(counts) and counts[-1] == 5
    plain = client.completions.create(
        model="smol", prompt="1, 2, 3,", max_tokens=5, temperature=0,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    ids_only = client.completions.create(
        model="smol", prompt="1, 2, 3,", max_tokens=5, temperature=0,
        extra_body={"detokenize": False},
    )  # fmt: skip
    assert plain.choices[0].text and ids_only.choices[0].text == ""
    token_ids = ids_only.choices[0].model_extra["token_ids"]  # type: ignore[index]
    assert token_ids == plain.choices[0].model_extra["token_ids"]  # type: ignore[index]


def test_the_access_log(server: Server) -> None:
    rid = "access-log-probe-1"
    body = {"model": "smol", "prompt": "Hello", "max_tokens": 3, "temperature": 0}
    headers = {"X-Request-Id": rid}
    assert httpx.post(server.base_url + "/completions", json=body, headers=headers).is_success
    bad = httpx.post(server.base_url + "/completions", json=body | {"fo": 1}, headers=headers)
    assert bad.status_code == 400

    def lines() -> list[dict[str, object]]:
        found = []
        for line in server.logs().splitlines():
            if rid in line and '"logger":"shuttle.access"' in line:
                found.append(json.loads(line))
        return found

    wait_until(lambda: len(lines()) >= 2, 60, "the access log's two lines")
    done, refused = lines()[:2]
    access = done["access"]
    assert isinstance(access, dict) and access["status"] == 200
    assert access["output_tokens"] == 3 and access["prompt_tokens"] >= 1
    assert access["route"] == "/v1/completions" and access["ttft_s"] is not None
    assert str(refused["msg"]).startswith(f"refused {rid} POST /v1/completions 400 (fo: unknown")


def test_continue_final_message_with_echo(client: openai.OpenAI) -> None:
    start = "The capital of France is"
    messages = [*CHAT, {"role": "assistant", "content": start}]
    out = client.chat.completions.create(
        model="smol",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=3,
        temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False, "echo": True},
    )
    content = out.choices[0].message.content or ""
    assert content.startswith(start) and len(content) > len(start)


def test_truncate_prompt_tokens_and_tokens_as_ids(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model="smol",
        prompt="one two three four five six seven eight nine ten",
        max_tokens=2,
        temperature=0,
        logprobs=1,
        extra_body={"truncate_prompt_tokens": 3, "return_tokens_as_token_ids": True},
    )
    assert out.usage is not None and out.usage.prompt_tokens == 3
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens
    assert all(t.startswith("token_id:") for t in logprobs.tokens)


def test_stop_strings_included_and_named(client: openai.OpenAI) -> None:
    args: dict[str, Any] = {
        "model": "smol", "prompt": "1, 2, 3, 4,", "max_tokens": 12, "temperature": 0,
        "stop": [","],
    }  # fmt: skip
    plain = client.completions.create(**args).choices[0]
    kept = client.completions.create(
        **args, extra_body={"include_stop_str_in_output": True}
    ).choices[0]
    assert plain.finish_reason == kept.finish_reason == "stop"
    assert kept.text == plain.text + ","
    assert plain.model_extra is not None and plain.model_extra["stop_reason"] == ","


def test_allowed_token_ids_and_cache_salt(client: openai.OpenAI) -> None:
    allowed = [28, 29, 30]  # "1", "2", "3" in SmolLM2's vocabulary (any ids would do)
    out = client.completions.create(
        model="smol",
        prompt="Count: 1, 2,",
        max_tokens=6,
        temperature=1.0,
        seed=1,
        extra_body={"allowed_token_ids": allowed, "return_token_ids": True, "cache_salt": "s"},
    )
    token_ids = out.choices[0].model_extra["token_ids"]  # type: ignore[index]
    assert len(token_ids) == 6 and set(token_ids) <= set(allowed)


def test_best_of_keeps_the_most_likely_of_the_same_samples(client: openai.OpenAI) -> None:
    args: dict[str, Any] = {
        "model": "smol", "prompt": "Once upon a time", "max_tokens": 6, "temperature": 1.0,
        "seed": 5, "logprobs": 0,
    }  # fmt: skip
    three = client.completions.create(**args, n=3).choices
    (best,) = client.completions.create(**args, n=1, extra_body={"best_of": 3}).choices

    def total(choice: Any) -> float:
        return sum(choice.logprobs.token_logprobs)

    assert best.text == max(three, key=total).text
