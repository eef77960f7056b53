"""Server-Sent Events framing for OpenAI-style streams, with no web framework in sight.

A stream is a run of `data: {json}\\n\\n` events, one chunk dict each, ended by
`data: [DONE]\\n\\n`. The chunk builders below produce the exact field names and order of
OpenAI's `chat.completion.chunk` and `text_completion` streams:

    {"id", "object", "created", "model", "system_fingerprint",
     "choices": [{"index", "delta" | "text", "logprobs": null, "finish_reason"}]}

A usage chunk has `"choices": []` and a `usage` object; an error mid-stream is an
`{"error": {...}}` data event, not a dropped connection.
"""

from __future__ import annotations

from typing import Any, Literal

import orjson

SSE_DONE = b"data: [DONE]\n\n"
DONE = "[DONE]"

_OBJECT_BY_KIND = {"chat": "chat.completion.chunk", "completion": "text_completion"}


def sse_event(obj: dict[str, Any]) -> bytes:
    """One `data:` event holding `obj` as compact JSON."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def sse_comment(text: str = "") -> bytes:
    """A comment event (`: text`), ignored by clients; used as a keep-alive."""
    # Each line of a multi-line comment needs its own colon, or it would become a field.
    lines = text.split("\n")
    return "".join(f": {line}\n" if line else ":\n" for line in lines).encode() + b"\n"


def _chunk(
    kind: Literal["chat", "completion"],
    request_id: str,
    model: str,
    created: int,
    system_fingerprint: str | None,
    choices: list[dict[str, Any]],
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": _OBJECT_BY_KIND[kind],
        "created": created,
        "model": model,
        "system_fingerprint": system_fingerprint,
        "choices": choices,
    }


def chat_chunk(
    request_id: str,
    model: str,
    created: int,
    delta: dict[str, Any],
    finish_reason: str | None,
    system_fingerprint: str | None,
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A `chat.completion.chunk` with one choice carrying `delta` (role and/or content);
    `extra`: fields of the chunk itself (vLLM's `prompt_logprobs`, in a chat response's)."""
    choice = {
        "index": index,
        "delta": delta,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }
    return _chunk("chat", request_id, model, created, system_fingerprint, [choice]) | (extra or {})


def completion_chunk(
    request_id: str,
    model: str,
    created: int,
    text: str,
    finish_reason: str | None,
    system_fingerprint: str | None,
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A `text_completion` stream chunk with one choice carrying `text`; `extra`: fields of
    the choice (vLLM's `prompt_logprobs`, in a completion choice's)."""
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    choice |= extra or {}
    return _chunk("completion", request_id, model, created, system_fingerprint, [choice])


def usage_chunk(
    kind: Literal["chat", "completion"],
    request_id: str,
    model: str,
    created: int,
    usage: dict[str, Any],
    system_fingerprint: str | None,
) -> dict[str, Any]:
    """The usage chunk sent before [DONE] when `stream_options.include_usage` is set."""
    chunk = _chunk(kind, request_id, model, created, system_fingerprint, [])
    chunk["usage"] = usage
    return chunk


def error_chunk(
    message: str, err_type: str, code: int | str | None = None, param: str | None = None
) -> dict[str, Any]:
    """An OpenAI error object, sent as a data event when a stream fails after it began."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}
