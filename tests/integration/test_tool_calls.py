"""Tool calling through the real server with the real `openai` client: required and named
calls (enforced by structured outputs) parse and their arguments validate against the
function's schema, streamed and not; auto gives either content or valid calls; a follow-up
turn with the assistant's tool_calls (content null) and the tool's answer is served; bad
tool_choice values are 400s naming the field."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from tests.server import Server

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 16}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
     "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a zone",
     "parameters": TIME}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", timeout=300, max_retries=0)


def _check_calls(calls: Any, names: set[str]) -> None:
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize(
    ("tool_choice", "names"),
    [
        ("required", {"get_weather", "get_time"}),
        ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
    ],
)
def test_forced_calls_parse_and_match_the_schema(
    server: Server, tool_choice: Any, names: set[str]
) -> None:
    out = _client(server).chat.completions.create(
        model=server.model,
        messages=ASK,
        tools=TOOLS,
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0.0,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    _check_calls(choice.message.tool_calls, names)
    assert len(choice.message.tool_calls or []) == 1  # parallel_tool_calls: false


def test_a_named_call_streams_name_first_then_arguments_in_pieces(server: Server) -> None:
    stream = _client(server).chat.completions.create(
        model=server.model,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,  # (a 135M model repeats a call until max_tokens otherwise)
        max_tokens=80,
        temperature=0.8,
        seed=1,
        stream=True,
    )
    names, arguments, finish, ids, pieces = [], "", None, [], 0
    for chunk in stream:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                if call.function and call.function.name:
                    names.append(call.function.name)
                    ids.append(call.id)
                    assert not arguments  # the name comes before any argument
                if call.function and call.function.arguments:
                    arguments += call.function.arguments
                    pieces += 1
            finish = choice.finish_reason or finish
    assert names == ["get_weather"] and ids[0] and finish == "tool_calls"
    assert pieces > 1  # the arguments stream as they are generated, not in one piece
    jsonschema.validate(json.loads(arguments), WEATHER)


def test_auto_gives_content_or_valid_calls_and_a_follow_up_turn_runs(server: Server) -> None:
    client = _client(server)
    out = client.chat.completions.create(
        model=server.model, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0.0
    )
    message = out.choices[0].message
    if message.tool_calls:
        assert out.choices[0].finish_reason == "tool_calls"
        _check_calls(message.tool_calls, set(SCHEMAS))
    else:
        assert message.content and out.choices[0].finish_reason in ("stop", "length")
    # the follow-up turn: the assistant's call (content null) and the tool's answer
    arguments = '{"city": "Paris", "unit": "celsius"}'
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": arguments}}  # fmt: skip
    follow = client.chat.completions.create(
        model=server.model,
        messages=[
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
        ],
        tools=TOOLS,
        tool_choice="none",
        max_tokens=20,
        temperature=0.0,
    )
    assert follow.choices[0].message.content
    assert not follow.choices[0].message.tool_calls


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),  # fmt: skip
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name"}}]},
            "tools[0].function.name",
        ),  # fmt: skip
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),  # fmt: skip
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "nonsense"}},
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
        ),  # fmt: skip
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(
    server: Server, body: dict[str, Any], field: str
) -> None:
    with server.client() as http:
        reply = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 5, **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == field and error["message"].startswith(field + ":"), error
