"""The Responses API's output items, built from an answer's text, and the stream events of a
whole item: a `message` with one `output_text` part, a `function_call` per tool call, and
(with --reasoning-parser) a `reasoning` item with one `reasoning_text` part."""

from __future__ import annotations

import uuid
from typing import Any

from common.messages import FinishReason
from services.gateway.openai.tools import ToolPlan, chat_message


def output_items(text: str, reason: FinishReason, plan: ToolPlan | None) -> list[dict[str, Any]]:
    """The output's items: a message with its text (unless only calls were made), then
    one function_call item per tool call."""
    message, _ = chat_message(text, reason.openai, plan)
    calls = message.get("tool_calls") or []
    items = [] if calls and not message["content"] else [message_item(message["content"] or "")]
    for call in calls:
        items.append(
            {
                "type": "function_call",
                "id": "fc_" + uuid.uuid4().hex,
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
                "status": "completed",
            }
        )
    return items


def reasoning_item(text: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": "rs_" + uuid.uuid4().hex,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": "completed",
    }


def message_item(text: str, status: str = "completed", item_id: str = "") -> dict[str, Any]:
    content = [text_part(text)] if status == "completed" else []
    return {
        "type": "message",
        "id": item_id or "msg_" + uuid.uuid4().hex,
        "status": status,
        "role": "assistant",
        "content": content,
    }


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def assistant_turn(items: list[dict[str, Any]]) -> dict[str, Any]:
    """The output as the chat message a later turn's history holds."""
    text = "".join(p["text"] for i in items if i["type"] == "message" for p in i["content"])
    calls = [
        {"id": i["call_id"], "type": "function", "function": _function(i)}
        for i in items
        if i["type"] == "function_call"
    ]
    turn: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    return turn | ({"tool_calls": calls} if calls else {})


def _function(item: dict[str, Any]) -> dict[str, Any]:
    return {"name": item["name"], "arguments": item["arguments"]}


def where(item: dict[str, Any], index: int = 0) -> dict[str, Any]:
    return {"item_id": item["id"], "output_index": index, "content_index": 0}


def part_event(stage: str, item: dict[str, Any], text: str, index: int = 0) -> dict[str, Any]:
    part = text_part(text)
    return where(item, index) | {"kind": f"response.content_part.{stage}", "part": part}


def item_events(index: int, item: dict[str, Any]) -> list[dict[str, Any]]:
    """A whole item's events, its text or arguments in one delta."""
    if item["type"] in ("message", "reasoning"):
        text = item["content"][0]["text"]
        return [
            *open_events(index, item),
            delta_event(index, item, text),
            *close_events(index, item),
        ]
    pos = {"output_index": index}
    added = item | {"status": "in_progress", "arguments": ""}
    at = {"item_id": item["id"]} | pos
    return [
        {"kind": "response.output_item.added", "item": added} | pos,
        at | {"kind": "response.function_call_arguments.delta", "delta": item["arguments"]},
        at | {"kind": "response.function_call_arguments.done", "arguments": item["arguments"]},
        {"kind": "response.output_item.done", "item": item} | pos,
    ]


def open_events(index: int, item: dict[str, Any]) -> list[dict[str, Any]]:
    """A message's or reasoning item's first events, before its text."""
    added = item | {"status": "in_progress", "content": []}
    out = [{"kind": "response.output_item.added", "item": added, "output_index": index}]
    if item["type"] == "message":
        out.append(part_event("added", item, "", index))
    return out


def delta_event(index: int, item: dict[str, Any], text: str) -> dict[str, Any]:
    """A piece of a message's or reasoning item's text."""
    if item["type"] == "message":
        return where(item, index) | {
            "kind": "response.output_text.delta",
            "delta": text,
            "logprobs": [],
        }
    return where(item, index) | {"kind": "response.reasoning_text.delta", "delta": text}


def close_events(index: int, item: dict[str, Any]) -> list[dict[str, Any]]:
    """A message's or reasoning item's last events (`item` with its whole text)."""
    text, at = item["content"][0]["text"], where(item, index)
    done = {"kind": "response.output_item.done", "item": item, "output_index": index}
    if item["type"] == "message":
        return [
            at | {"kind": "response.output_text.done", "text": text, "logprobs": []},
            part_event("done", item, text, index),
            done,
        ]
    return [at | {"kind": "response.reasoning_text.done", "text": text}, done]
