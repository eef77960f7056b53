"""The Responses API (services/gateway/http/responses.py) through the `openai` client's own
`responses` methods, on the real HTTP app over the scripted engine (which echoes the last
message's words back): create, stream, previous_response_id, a tool loop, GET and
DELETE, refusals naming Responses fields."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx
import openai
import pytest

from common.config import ServerConfig
from common.messages import FinishReason
from services.gateway.engine.client import OutputDelta
from services.gateway.http.app import create_app
from tests.fake_engine import FakeEngine

T = TypeVar("T")


def _with_client(engine: FakeEngine, work: Callable[[openai.AsyncOpenAI], Awaitable[T]]) -> T:
    async def go() -> T:
        transport = httpx.ASGITransport(app=create_app(engine, ServerConfig()))
        async with httpx.AsyncClient(transport=transport, base_url="http://test/v1") as http:
            client = openai.AsyncOpenAI(
                base_url="http://test/v1", api_key="x", http_client=http, max_retries=0
            )
            return await work(client)

    return asyncio.run(go())


def test_create_then_continue_from_the_stored_response() -> None:
    engine = FakeEngine()

    async def work(client: openai.AsyncOpenAI) -> tuple[Any, Any, Any]:
        first = await client.responses.create(
            model="test-model", input="hello big world", instructions="Be brief."
        )
        second = await client.responses.create(
            model="test-model", input="and then", previous_response_id=first.id
        )
        return first, second, await client.responses.retrieve(first.id)

    first, second, got = _with_client(engine, work)
    assert first.status == "completed" and first.output_text == " hello big world"
    assert first.usage.input_tokens == 5 and first.usage.output_tokens == 3
    assert got.id == first.id and got.output_text == first.output_text
    messages = engine.requests[0].messages
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello big world"},
    ]
    # the second: the first's turns (not its instructions), its answer, then the new input
    assert engine.requests[1].messages == [
        {"role": "user", "content": "hello big world"},
        {"role": "assistant", "content": " hello big world"},
        {"role": "user", "content": "and then"},
    ]
    assert second.previous_response_id == first.id


def test_stream_events_build_the_final_response() -> None:
    async def work(client: openai.AsyncOpenAI) -> tuple[list[str], Any]:
        async with client.responses.stream(model="test-model", input="one two") as stream:
            kinds = [event.type async for event in stream]
            return kinds, await stream.get_final_response()

    kinds, final = _with_client(FakeEngine(), work)
    assert kinds[:4] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added",
    ]  # fmt: skip
    assert kinds.count("response.output_text.delta") == 2
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    assert final.output_text == " one two" and final.status == "completed"


CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_loop(stream: bool) -> None:
    engine = FakeEngine()
    engine.scripts["call-1"] = [OutputDelta(CALL, [7], FinishReason.STOP, 9, 12, last=True)]

    async def work(client: openai.AsyncOpenAI) -> tuple[Any, Any]:
        args: dict[str, Any] = {"model": "test-model", "input": "Weather in Paris?"}
        headers = {"X-Request-Id": "call-1"}
        if stream:
            async with client.responses.stream(
                **args, tools=[WEATHER], extra_headers=headers
            ) as events:
                first = await events.get_final_response()
        else:
            first = await client.responses.create(**args, tools=[WEATHER], extra_headers=headers)
        call = first.output[0]
        second = await client.responses.create(
            model="test-model",
            previous_response_id=first.id,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        )
        return first, second

    first, second = _with_client(engine, work)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.arguments == '{"city":"Paris"}'
    assert engine.requests[0].tools[0]["name"] == "get_weather"
    turns = engine.requests[1].messages
    assert turns[1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": "get_weather",
             "arguments": '{"city":"Paris"}'}},
        ],
    }  # fmt: skip
    assert turns[2] == {"role": "tool", "content": "sunny", "tool_call_id": call.call_id}
    assert second.output_text == " sunny"


def test_text_format_asks_for_a_grammar_and_refusals_name_responses_fields() -> None:
    engine = FakeEngine()
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    fmt = {"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": True}}

    async def work(client: openai.AsyncOpenAI) -> list[Any]:
        await client.responses.create(model="test-model", input="hi", text=fmt)  # type: ignore[arg-type]
        errors = []
        for extra in (
            {"max_output_tokens": 10**6},
            {"text": {"format": {"type": "yaml"}}},
            {"max_output_token": 5},
            {"background": True},
        ):
            with pytest.raises(openai.BadRequestError) as info:
                await client.responses.create(model="test-model", input="hi", extra_body=extra)
            errors.append(info.value.body)
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(
                model="test-model", input="hi", previous_response_id="resp_nope"
            )
        return errors

    errors = _with_client(engine, work)
    assert engine.requests[0].sampling.structured_kind == "json"
    assert [e["param"] for e in errors] == [
        "max_output_tokens", "text.format", "max_output_token", "background",
    ]  # fmt: skip
    assert "did you mean `max_output_tokens`" in errors[2]["message"]


def test_delete_and_unstored_responses() -> None:
    async def work(client: openai.AsyncOpenAI) -> None:
        kept = await client.responses.create(model="test-model", input="a b")
        await client.responses.delete(kept.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(kept.id)
        gone = await client.responses.create(model="test-model", input="a b", store=False)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(gone.id)

    _with_client(FakeEngine(), work)
