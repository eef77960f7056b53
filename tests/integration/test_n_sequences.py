"""OpenAI `n` > 1 through the real processes: one request, n sequences sharing the prompt."""

from __future__ import annotations

import openai
import pytest

from tests.server import Server

CHAT = [{"role": "user", "content": "Name a colour."}]
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", timeout=120, max_retries=0)


def test_greedy_chat_choices_equal_the_single_answer(server: Server, client: openai.OpenAI) -> None:
    args = dict(model=server.model, messages=CHAT, max_tokens=16, temperature=0.0)
    one = client.chat.completions.create(**args)  # type: ignore[call-overload]
    three = client.chat.completions.create(**args, n=3)  # type: ignore[call-overload]
    answer = one.choices[0].message.content
    assert answer
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert [c.message.content for c in three.choices] == [answer] * 3
    assert [c.finish_reason for c in three.choices] == [one.choices[0].finish_reason] * 3
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens


def test_streamed_choices_equal_the_non_streamed(server: Server, client: openai.OpenAI) -> None:
    args = dict(model=server.model, prompt=PROMPT, max_tokens=10, temperature=0.0, n=2)
    whole = client.completions.create(  # type: ignore[call-overload]
        **args, extra_body={"return_token_ids": True}
    )
    texts: dict[int, str] = {0: "", 1: ""}
    finishes: dict[int, str] = {}
    usage = None
    stream = client.completions.create(  # type: ignore[call-overload]
        **args, stream=True, stream_options={"include_usage": True}
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert [texts[0], texts[1]] == [c.text for c in whole.choices]
    assert texts[0]
    assert finishes == {c.index: c.finish_reason for c in whole.choices}
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    per_choice = [len(c.token_ids) for c in whole.choices]  # type: ignore[attr-defined]
    assert whole.usage.completion_tokens == sum(per_choice) and per_choice[0] == per_choice[1]


def test_seeded_sampling_repeats(server: Server, client: openai.OpenAI) -> None:
    args = dict(model=server.model, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7, n=2)
    first = client.completions.create(**args)  # type: ignore[call-overload]
    second = client.completions.create(**args)  # type: ignore[call-overload]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert len(first.choices) == 2
    total = first.usage.completion_tokens
    assert total == second.usage.completion_tokens and 2 <= total <= 16
