"""Tool calling in the gateway, without processes: the request's tools and tool_choice, the
hermes and json parsers (whole and streamed), and the HTTP answers (tool_calls, content
null, finish_reason "tool_calls") from a scripted engine."""

from __future__ import annotations

from typing import Any

import jsonschema
import orjson
import pytest

from services.gateway.openai.structured import StructuredError
from services.gateway.openai.tools import (
    ToolPlan,
    chat_message,
    forced_grammar,
    parse_output,
    plan_tools,
)
from tests.fake_engine import FakeEngine, delta
from tests.unit.services.gateway.http.test_app import CHAT, STOP, chat_body, error_of, run

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": PARAMS}},
    {"type": "function", "function": {"name": "time", "description": "now"}},
]
CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _plan(choice: Any = None, parser: str = "hermes", parallel: bool | None = None) -> ToolPlan:
    plan = plan_tools(TOOLS, choice, parallel, parser)
    assert plan is not None
    return plan


# --- the request ------------------------------------------------------------------------------
def test_tool_choice_modes() -> None:
    assert _plan().choice == "auto" and _plan().parser == "hermes"
    assert plan_tools(TOOLS, "none", None, "hermes") is None
    assert plan_tools(None, None, None, "hermes") is None
    required = _plan("required")
    assert (required.choice, required.parser, required.parallel) == ("required", "json", True)
    named = _plan({"type": "function", "function": {"name": "time"}}, parallel=False)
    assert (named.choice, named.forced_name, named.parallel) == ("named", "time", False)


@pytest.mark.parametrize(
    ("tools", "choice", "field"),
    [
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name"),
        (TOOLS, "always", "tool_choice"),
        (None, "required", "tool_choice"),
        ([{"type": "retrieval"}], None, "tools[0].type"),
        ([{"type": "function", "function": {"name": "a b"}}], None, "tools[0].function.name"),
        ([TOOLS[0], TOOLS[0]], None, "tools[1].function.name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": []}}],
            None,
            "tools[0].function.parameters",
        ),
        (
            [{"type": "function", "function": {"name": "f", "examples": [1]}}],
            None,
            "tools[0].function.examples",
        ),  # fmt: skip
    ],
)
def test_bad_tools_name_the_field(tools: Any, choice: Any, field: str) -> None:
    with pytest.raises(StructuredError) as e:
        plan_tools(tools, choice, None, "hermes")
    assert e.value.field == field


def test_forced_grammar_is_a_list_of_calls_of_the_allowed_tools() -> None:
    grammar = forced_grammar(
        _plan({"type": "function", "function": {"name": "weather"}}, parallel=False)
    )
    assert grammar is not None and grammar.kind == "json"
    schema = orjson.loads(grammar.spec)
    jsonschema.validate([{"name": "weather", "arguments": {"city": "x"}}], schema)
    for bad in ([], [{"name": "time", "arguments": {}}], [{"name": "weather", "arguments": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    with pytest.raises(jsonschema.ValidationError):  # one call only: parallel_tool_calls false
        jsonschema.validate([{"name": "weather", "arguments": {"city": "x"}}] * 2, schema)
    either = orjson.loads(forced_grammar(_plan("required")).spec)  # type: ignore[union-attr]
    jsonschema.validate([{"name": "time", "arguments": {}}], either)
    assert forced_grammar(_plan()) is None  # auto: free


# --- the output -------------------------------------------------------------------------------
def test_hermes_parser_takes_calls_out_of_the_text() -> None:
    content, calls = parse_output("Let me look.\n" + CALL, _plan())
    assert content == "Let me look."
    assert [(c.name, orjson.loads(c.arguments)) for c in calls] == [("weather", {"city": "Paris"})]
    assert (
        parse_output(CALL + CALL, _plan())[0] is None
        and len(parse_output(CALL + CALL, _plan())[1]) == 2
    )
    # unknown tools and broken JSON stay text
    for text in ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', "<tool_call>{oops"):
        assert parse_output(text, _plan()) == (text, [])


def test_json_parser_reads_one_call_or_a_list() -> None:
    plan = _plan(parser="json")
    one = '{"name": "time", "arguments": {}}'
    assert [c.name for c in parse_output(one, plan)[1]] == ["time"]
    assert [c.name for c in parse_output(f"[{one}, {one}]", plan)[1]] == ["time", "time"]
    assert parse_output("just words", plan) == ("just words", [])


def test_the_message() -> None:
    message, finish = chat_message(CALL, "stop", _plan())
    assert message["content"] is None and finish == "tool_calls"
    assert message["tool_calls"][0]["function"]["name"] == "weather"
    assert chat_message("hi", "stop", _plan()) == ({"role": "assistant", "content": "hi"}, "stop")
    assert chat_message(CALL, "length", _plan())[1] == "length"


# --- over HTTP (a scripted engine) ------------------------------------------------------------
def test_chat_answers_with_tool_calls() -> None:
    engine = FakeEngine(script=[delta("Checking. "), delta(CALL, STOP)])
    resp = run(engine, "POST", CHAT, json=chat_body(tools=TOOLS))
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking."
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "weather"
    sent = engine.requests[-1]  # the tokenizer renders the tools (services/tokenizer/tool_prompt)
    assert [fn["name"] for fn in sent.tools] == ["weather", "time"]
    assert sent.messages == [{"role": "user", "content": "hello big world"}]


def test_chat_streams_tool_calls_name_first() -> None:
    engine = FakeEngine(script=[delta("Checking. <tool_"), delta(CALL[6:], STOP)])
    resp = run(engine, "POST", CHAT, json=chat_body(tools=TOOLS, stream=True))
    chunks = [
        orjson.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")
    ]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == "Checking. "
    calls = [d["tool_calls"][0] for d in deltas if d.get("tool_calls")]
    assert calls[0]["function"]["name"] == "weather" and calls[0]["id"].startswith("call_")
    assert orjson.loads(calls[1]["function"]["arguments"]) == {"city": "Paris"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_named_call_is_forced_by_a_grammar_and_an_unknown_name_is_a_400() -> None:
    engine = FakeEngine()
    body = chat_body(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "time"}})
    assert run(engine, "POST", CHAT, json=body).status_code == 200
    sampling = engine.requests[-1].sampling
    assert (sampling.structured_kind, sampling.structured_field) == ("json", "tools")
    body["tool_choice"]["function"]["name"] = "nope"
    error = error_of(run(engine, "POST", CHAT, json=body), 400)
    assert error["param"] == "tool_choice.function.name"


def test_content_null_only_with_tool_calls() -> None:
    engine = FakeEngine()
    body = chat_body(messages=[{"role": "user", "content": None}])
    assert error_of(run(engine, "POST", CHAT, json=body), 400)["param"].startswith("messages[0]")
