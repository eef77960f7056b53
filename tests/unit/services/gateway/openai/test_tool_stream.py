"""Tool calls streamed as they are generated (services/gateway/openai/tool_stream.py): the name
first, then the arguments in pieces, for the hermes and json parsers, fed a character at a
time and in one piece; what cannot be streamed is read whole at its end."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from services.gateway.openai.tool_stream import ToolStream
from services.gateway.openai.tools import ToolPlan, plan_tools

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": PARAMS}},
    {"type": "function", "function": {"name": "time"}},
]
CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Pa{r}is \\"x\\""}}\n</tool_call>'
ARGS = {"city": 'Pa{r}is "x"'}


def _plan(parser: str = "hermes") -> ToolPlan:
    plan = plan_tools(TOOLS, None, None, parser)
    assert plan is not None
    return plan


def _run(stream: ToolStream, text: str, by_char: bool) -> tuple[str, list[dict[str, Any]]]:
    """Content and deltas of the whole stream, fed by character or in one piece."""
    content, deltas = "", []
    for part in list(text) if by_char else [text]:
        piece = stream.feed(part)
        content, deltas = content + piece.content, deltas + piece.deltas
    rest, _ = stream.finish()
    return content + rest.content, deltas + rest.deltas


def _calls(deltas: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """The calls a client rebuilds from the deltas: (name, arguments object) by index."""
    calls: dict[int, dict[str, str]] = {}
    for d in deltas:
        (item,) = d["tool_calls"]
        call = calls.setdefault(item["index"], {"name": "", "arguments": ""})
        call["name"] += item["function"].get("name", "")
        call["arguments"] += item["function"]["arguments"]
    return [(c["name"], orjson.loads(c["arguments"])) for _, c in sorted(calls.items())]


@pytest.mark.parametrize("by_char", [True, False])
def test_hermes_streams_the_name_then_the_arguments(by_char: bool) -> None:
    stream = ToolStream(_plan())
    content, deltas = _run(stream, "Sure <thing>. " + CALL + "\n" + CALL, by_char)
    assert content == "Sure <thing>. "
    assert _calls(deltas) == [("weather", ARGS), ("weather", ARGS)]
    head = deltas[0]["tool_calls"][0]
    assert head["id"].startswith("call_") and head["function"] == {
        "name": "weather",
        "arguments": "",
    }
    assert stream.called and [c.name for c in stream.finish()[1]] == ["weather", "weather"]
    if by_char:  # the arguments came in many pieces, before the call's end
        assert len(deltas) > 10


def test_the_name_goes_out_before_the_arguments_are_written() -> None:
    stream = ToolStream(_plan())
    piece = stream.feed('<tool_call>{"name": "weather", "arguments": {"ci')
    assert piece.content == "" and piece.deltas[0]["tool_calls"][0]["function"]["name"] == "weather"
    assert piece.deltas[1]["tool_calls"][0]["function"]["arguments"] == '{"ci'


@pytest.mark.parametrize("by_char", [True, False])
def test_json_streams_a_list_of_calls(by_char: bool) -> None:
    text = '[{"name": "weather", "arguments": {"city": "Oslo"}}, {"name": "time", "arguments": {}}]'
    content, deltas = _run(ToolStream(_plan("json")), text, by_char)
    assert content == "" and _calls(deltas) == [("weather", {"city": "Oslo"}), ("time", {})]
    one = '{"name": "time", "arguments": {}}'
    assert _calls(_run(ToolStream(_plan("json")), one, by_char)[1]) == [("time", {})]


@pytest.mark.parametrize("by_char", [True, False])
def test_what_cannot_stream_is_read_whole_at_its_end(by_char: bool) -> None:
    # other key order, string arguments: still calls, sent at their end
    odd = '<tool_call>{"arguments": {"city": "Rome"}, "name": "weather"}</tool_call>'
    content, deltas = _run(ToolStream(_plan()), "a " + odd + " b", by_char)
    assert _calls(deltas) == [("weather", {"city": "Rome"})] and content == "a b"
    # an unknown tool or broken JSON stays text
    for text in ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', "<tool_call>{oops"):
        assert _run(ToolStream(_plan()), text, by_char) == (text, [])
    # a call whose close tag never came (the model stopped after it)
    unclosed = '<tool_call>{"name": "time", "arguments": {}}'
    assert _calls(_run(ToolStream(_plan()), unclosed, by_char)[1]) == [("time", {})]
    # json: not a call list
    assert _run(ToolStream(_plan("json")), "just words", by_char) == ("just words", [])
    swapped = '[{"arguments": {}, "name": "time"}]'
    assert _calls(_run(ToolStream(_plan("json")), swapped, by_char)[1]) == [("time", {})]


def test_a_partial_tag_is_held_until_it_is_decided() -> None:
    stream = ToolStream(_plan())
    assert stream.feed("no calls <tool").content == "no calls "
    assert stream.feed("s here").content == "<tools here"
    piece, calls = stream.finish()
    assert piece.content == "" and calls == [] and not stream.called
