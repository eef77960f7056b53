"""Tool calling: `tools`, `tool_choice`, `parallel_tool_calls` in, `tool_calls` out.

Prompt: the tokenizer renders the tools, by the chat template when it has tool support,
else by a built-in Hermes-style prompt (services/tokenizer/tool_prompt.py); the gateway
sends it the conversation as the client wrote it and the functions of the plan.

Output (`parse_output`), by `--tool-call-parser`: `hermes` finds the `<tool_call>{json}
</tool_call>` blocks (text around them stays content); `json` reads the whole output as one
call object or a list of them. `tool_choice` `required` or a named function is enforced with
structured outputs: the output is a JSON list of calls (one call unless
`parallel_tool_calls`) whose arguments match the function's parameter schema, read by the
`json` parser whatever the server's parser. `none`: no tools in the prompt, no parsing.
"""

from __future__ import annotations

import dataclasses
import re
import uuid
from typing import Any

import orjson

from services.gateway.openai.structured import Structured, StructuredError, no_unknown_keys

PARSERS = ("hermes", "json")
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
OPEN_TAG = "<tool_call>"
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclasses.dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = dataclasses.field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclasses.dataclass(frozen=True, slots=True)
class ToolPlan:
    """A request's tools and how its output is read."""

    tools: dict[str, dict[str, Any]]  # name -> its function object (name, description, params)
    choice: str  # auto | required | named
    forced_name: str | None  # the named function
    parallel: bool
    parser: str  # hermes | json (required/named: json)

    @property
    def is_forced(self) -> bool:
        return self.choice in ("required", "named")


def check_tools(value: Any) -> dict[str, dict[str, Any]]:
    """`tools` as name -> function; StructuredError naming the offending entry."""
    if not isinstance(value, list):
        raise StructuredError("tools", "must be a list of tools")
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise StructuredError(f"{where}.type", 'must be "function"')
        no_unknown_keys(tool, {"type", "function"}, where)
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise StructuredError(f"{where}.function", "must be a JSON object")
        # `strict` is accepted: forced calls (required, named) always match the schema; an
        # auto call's arguments are checked as JSON, not against it (docs/operations.md 10)
        no_unknown_keys(fn, {"name", "description", "parameters", "strict"}, f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise StructuredError(
                f"{where}.function.name", "must be 1..64 letters, digits, '_', '.' or '-'"
            )
        if name in out:
            raise StructuredError(f"{where}.function.name", f"{name!r} is given twice")
        params = fn.get("parameters", _EMPTY_PARAMETERS)
        if not isinstance(params, dict):
            raise StructuredError(f"{where}.function.parameters", "must be a JSON schema object")
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise StructuredError(f"{where}.function.description", "must be a string")
        out[name] = {"name": name, "description": description or "", "parameters": params}
    return out


def plan_tools(tools: Any, tool_choice: Any, parallel: bool | None, parser: str) -> ToolPlan | None:
    """The request's ToolPlan (None: no tools, or tool_choice none)."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none"):
            raise StructuredError("tool_choice", "needs tools")
        return None
    known = check_tools(tools)
    choice, name = "auto", None
    if tool_choice is None or tool_choice == "auto":
        pass
    elif tool_choice == "none":
        return None
    elif tool_choice == "required":
        choice = "required"
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise StructuredError("tool_choice.function.name", "must be a string")
        if name not in known:
            raise StructuredError(
                "tool_choice.function.name", f"{name!r} is not one of the request's tools"
            )
        choice = "named"
    else:
        raise StructuredError(
            "tool_choice",
            'must be "none", "auto", "required" or {"type": "function", "function": {"name"}}',
        )
    forced = choice in ("required", "named")
    return ToolPlan(known, choice, name, parallel is not False, "json" if forced else parser)


def forced_grammar(plan: ToolPlan) -> Structured | None:
    """required / named: a JSON list of calls whose arguments match the parameters."""
    if not plan.is_forced:
        return None
    names = [plan.forced_name] if plan.forced_name else list(plan.tools)
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": name},
                "arguments": plan.tools[name]["parameters"],
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name in names
    ]
    item = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
    if not plan.parallel:
        schema["maxItems"] = 1
    return Structured("json", orjson.dumps(schema).decode(), "tools")


def parse_output(text: str, plan: ToolPlan) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a finished output; no call found: the text is content."""
    if plan.parser == "json":
        calls = _json_calls(text, plan)
        return (None, calls) if calls else (text, [])
    calls, rest = [], text
    for match in _HERMES_CALL.finditer(text):
        call = _one_call(match.group(1), plan)
        if call is None:
            continue  # not a well-formed call of a known tool: it stays in the content
        calls.append(call)
        rest = rest.replace(match.group(0), "", 1)
    if not calls:
        return text, []
    content = rest.strip()
    return content or None, calls


def _json_calls(text: str, plan: ToolPlan) -> list[ToolCall]:
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return []
    items = value if isinstance(value, list) else [value]
    calls = [_call_of(item, plan) for item in items]
    return [c for c in calls if c is not None] if all(calls) else []


def _one_call(body: str, plan: ToolPlan) -> ToolCall | None:
    try:
        return _call_of(orjson.loads(body), plan)
    except orjson.JSONDecodeError:
        return None


def _call_of(item: Any, plan: ToolPlan) -> ToolCall | None:
    if not isinstance(item, dict) or item.get("name") not in plan.tools:
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None
    return ToolCall(item["name"], orjson.dumps(arguments).decode())


def chat_message(
    text: str, finish: str | None, plan: ToolPlan | None
) -> tuple[dict[str, Any], str | None]:
    """A finished chat choice's message and finish reason: with calls, `tool_calls`
    (content null when nothing else was said) and finish reason "tool_calls"."""
    if plan is None:
        return {"role": "assistant", "content": text}, finish
    content, calls = parse_output(text, plan)
    if not calls:
        return {"role": "assistant", "content": text}, finish
    message = {"role": "assistant", "content": content, "tool_calls": [c.as_dict() for c in calls]}
    return message, "tool_calls" if finish == "stop" else finish
