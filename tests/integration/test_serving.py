"""The real processes on the real small model, through the `openai` client and raw HTTP."""

from __future__ import annotations

import asyncio
import threading

import httpx
import openai
import pytest

from tests.server import Server

CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", timeout=120, max_retries=0)


def test_models_and_health(server: Server, client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [server.model]
    assert httpx.get(server.url + "/health").status_code == 200


def test_streaming_chat_is_coherent(server: Server, client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=server.model,
        messages=CHAT,
        max_tokens=24,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert "Paris" in text, text
    assert finish in (["stop"], ["length"])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    assert len({c.id for c in chunks}) == 1


def test_non_streaming_chat_and_completion(server: Server, client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model=server.model, messages=CHAT, max_tokens=24, temperature=0.0
    )
    assert "Paris" in chat.choices[0].message.content
    assert chat.usage.prompt_tokens > 10 and chat.system_fingerprint
    comp = client.completions.create(
        model=server.model, prompt="1, 2, 3, 4,", max_tokens=8, temperature=0.0
    )
    assert comp.choices[0].text.strip().startswith("5")
    assert comp.usage.completion_tokens == 8 and comp.choices[0].finish_reason == "length"


def test_streaming_completion_matches_non_streaming(server: Server, client: openai.OpenAI) -> None:
    args = dict(model=server.model, prompt="The quick brown fox", max_tokens=16, temperature=0.0)
    whole = client.completions.create(**args).choices[0].text
    parts = [c.choices[0].text for c in client.completions.create(**args, stream=True) if c.choices]
    assert "".join(parts) == whole and whole


def test_stop_string_is_not_emitted(server: Server, client: openai.OpenAI) -> None:
    args = dict(model=server.model, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0.0)
    full = client.completions.create(**args).choices[0].text
    assert " 7," in full
    cut = client.completions.create(**args, stop=[" 7"]).choices[0]
    assert cut.text == full[: full.index(" 7")] and cut.finish_reason == "stop"


def test_request_id_is_echoed(server: Server) -> None:
    r = httpx.post(
        server.base_url + "/chat/completions",
        timeout=60,
        headers={"X-Request-Id": "my-id-42"},
        json={"model": server.model, "messages": CHAT, "max_tokens": 4},
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "my-id-42"
    assert r.json()["id"] == "chatcmpl-my-id-42"  # vLLM prefixes the body id
    r = httpx.post(
        server.base_url + "/chat/completions",
        timeout=60,
        json={"model": server.model, "messages": CHAT, "max_tokens": 2},
    )
    assert r.headers["x-request-id"] == r.json()["id"]


def _prompts(n: int) -> list[str]:
    topics = [
        "cats",
        "the moon",
        "bread",
        "rivers",
        "chess",
        "winter",
        "music",
        "trains",
        "bees",
        "glass",
        "salt",
        "maps",
        "clocks",
        "ships",
        "tea",
        "stone",
    ]
    return [f"Write one sentence about {topics[i % len(topics)]}." for i in range(n)]


def test_16_concurrent_streams_equal_their_solo_output(server: Server) -> None:
    prompts = _prompts(16)

    async def one(c: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await c.chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=24,
            temperature=0.0,
            stream=True,
        )
        return "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])

    async def run(together: bool) -> list[str]:
        async with openai.AsyncOpenAI(
            base_url=server.base_url, api_key="x", timeout=300, max_retries=0
        ) as c:
            if together:
                return list(await asyncio.gather(*(one(c, p) for p in prompts)))
            return [await one(c, p) for p in prompts]

    solo = asyncio.run(run(False))
    together = asyncio.run(run(True))
    assert all(solo) and together == solo


def test_seeded_sampling_repeats_exactly(server: Server, client: openai.OpenAI) -> None:
    args = dict(
        model=server.model, messages=CHAT, max_tokens=24, temperature=1.0, top_p=0.95, seed=1234
    )
    first = client.chat.completions.create(**args).choices[0].message.content
    # the same seed again, this time beside other traffic in the batch
    noise = threading.Thread(
        target=lambda: client.chat.completions.create(
            model=server.model, messages=CHAT, max_tokens=24, temperature=1.0
        )
    )
    noise.start()
    second = client.chat.completions.create(**args).choices[0].message.content
    noise.join()
    assert first == second
    other = {
        client.chat.completions.create(**{**args, "seed": s}).choices[0].message.content
        for s in (1, 2, 3)
    }
    assert len(other | {first}) > 1, "different seeds should not all give the same text"
