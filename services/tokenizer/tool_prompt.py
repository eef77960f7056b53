"""How a chat with tools becomes the messages a chat template renders. No transformers import.

Two ways, chosen by the template that renders the request (the request's, the operator's or
the model's, as services/tokenizer/chat_template.py orders them):

- **the template's own** — a template that reads the `tools` variable (Qwen2.5, Llama 3.1,
  Hermes, Mistral ... ship one; a tokenizer may also carry a named `tool_use` template) gets
  the conversation as OpenAI sent it (assistant `tool_calls` with their arguments as objects,
  as Hugging Face templates expect, `tool` messages with `tool_call_id`) and `tools=`;
- **the built-in Hermes-style prompt**, for templates with no tool support (the default
  model's): the tool list goes into the system message,

      # Tools
      You may call one or more functions to assist with the user query.
      <tools>
      {"type": "function", "function": {"name": ..., "description": ..., "parameters": ...}}
      </tools>
      For each function call, return a json object with function name and arguments within
      <tool_call></tool_call> XML tags:
      <tool_call>
      {"name": <function-name>, "arguments": <args-json-object>}
      </tool_call>

  an assistant turn's `tool_calls` become such blocks in its content, and a `tool` message a
  user turn `<tool_response>...</tool_response>`.

Either way the prompt must show every tool (`check_tools_rendered`: each name appears more
often than in the same conversation rendered without tools, where earlier calls may name
it): a template that drops the system message, or a tool template that ignores the list,
would leave the model blind to the tools while the client believes it sees them — that
request is refused (400, `tools`) rather than served.
"""

from __future__ import annotations

import functools
from typing import Any

import jinja2
import orjson
from jinja2 import meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from services.tokenizer.validate import InvalidRequest

_TOOL_USE = "tool_use"  # a tokenizer's named template for requests with tools (transformers')


def renders_tools(template: str | dict[str, str] | None) -> bool:
    """Whether `template` (a Jinja text, or a tokenizer's named templates) renders `tools`."""
    if isinstance(template, dict):
        return _TOOL_USE in template or any(_reads_tools(t) for t in template.values())
    return template is not None and _reads_tools(template)


@functools.lru_cache(maxsize=64)
def _reads_tools(text: str) -> bool:
    try:
        parsed = ImmutableSandboxedEnvironment().parse(text)
    except jinja2.TemplateSyntaxError:
        return False  # rendering will fail and say why
    return "tools" in meta.find_undeclared_variables(parsed)


def tool_specs(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The functions as `tools=` of apply_chat_template takes them (OpenAI's shape)."""
    return [{"type": "function", "function": fn} for fn in tools]


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation for a tool-aware template: as sent, with each call's arguments as
    an object (Hugging Face templates write `arguments | tojson`)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [
                {**c, "function": {**c["function"], "arguments": _arguments(c["function"])}}
                for c in m["tool_calls"]
            ]
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def builtin_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """The built-in prompt: the tool list into the system message, assistant tool calls
    and tool results as text any chat template renders like other turns."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m["role"]
        if role == "assistant" and m.get("tool_calls"):
            blocks = [_call_block(c) for c in m["tool_calls"]]
            text = "\n".join(([m["content"]] if m.get("content") else []) + blocks)
            out.append({"role": "assistant", "content": text})
        elif role == "tool":
            response = f"<tool_response>\n{m['content']}\n</tool_response>"
            out.append({"role": "user", "content": response})
        else:
            out.append({k: v for k, v in m.items() if k in ("role", "content", "name")})
    if tools:
        block = _tools_block(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def check_tools_rendered(text: str, bare: str, tools: list[dict[str, Any]]) -> None:
    """Refuse a prompt (`text`) that does not show every tool: each name must appear more
    often than in `bare`, the conversation rendered without tools."""
    missing = [fn["name"] for fn in tools if text.count(fn["name"]) <= bare.count(fn["name"])]
    if missing:
        raise InvalidRequest(
            "tools",
            f"the chat template does not render the tools (no {', '.join(map(repr, missing))} "
            "in the prompt): use a model or --chat-template with tool support",
        )


def _arguments(fn: dict[str, Any]) -> Any:
    try:
        return orjson.loads(fn["arguments"])
    except orjson.JSONDecodeError:
        return fn["arguments"]  # the client's text, as it sent it


def _call_block(call: dict[str, Any]) -> str:
    fn = call["function"]
    body = orjson.dumps({"name": fn["name"], "arguments": _arguments(fn)}).decode()
    return f"<tool_call>\n{body}\n</tool_call>"


def _tools_block(tools: list[dict[str, Any]]) -> str:
    lines = "\n".join(orjson.dumps(spec).decode() for spec in tool_specs(tools))
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        f"{lines}\n</tools>\n\nFor each function call, return a json object with function "
        "name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )
