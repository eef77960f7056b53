"""The Responses API on the real processes and the real small model, through the `openai`
client: responses.create, responses.stream, responses.parse with a pydantic model, a
two-turn tool loop, previous_response_id, GET and DELETE."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import openai
import pytest
from pydantic import BaseModel

from tests.server import Server, running_server

QUESTION = "What is the capital of France?"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with running_server("--served-model-name", "smol") as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", timeout=120, max_retries=0)


def test_create_retrieve_and_continue(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model="smol", input=QUESTION, max_output_tokens=8, temperature=0
    )
    assert first.status in ("completed", "incomplete") and first.output_text
    assert first.usage is not None and first.usage.output_tokens <= 8
    assert client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(
        model="smol",
        input="And of Italy?",
        previous_response_id=first.id,
        max_output_tokens=8,
        temperature=0,
    )
    assert second.output_text and second.previous_response_id == first.id
    # the history went in: the second prompt is longer than the first
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_stream_equals_create(client: openai.OpenAI) -> None:
    args = {"model": "smol", "input": QUESTION, "max_output_tokens": 8, "temperature": 0}
    whole = client.responses.create(**args)  # type: ignore[call-overload]
    with client.responses.stream(**args) as stream:  # type: ignore[arg-type]
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == whole.output_text
    assert len(deltas) > 1


class Capital(BaseModel):
    country: Literal["France", "Italy", "Spain"]
    capital: Literal["Paris", "Rome", "Madrid"]


def test_parse_into_a_pydantic_model(client: openai.OpenAI) -> None:
    out = client.responses.parse(
        model="smol", input=QUESTION, text_format=Capital, max_output_tokens=40, temperature=0
    )
    assert isinstance(out.output_parsed, Capital)


def test_a_two_turn_tool_loop(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model="smol",
        input="What is the weather in Paris?",
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required",
        max_output_tokens=60,
        temperature=0,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    second = client.responses.create(
        model="smol",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}],
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="none",
        max_output_tokens=12,
        temperature=0,
    )
    assert second.output_text and not [i for i in second.output if i.type == "function_call"]
