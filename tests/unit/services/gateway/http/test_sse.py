"""SSE framing: exact bytes, OpenAI field names, and a parser round trip."""

from __future__ import annotations

import orjson
import pytest

from services.gateway.http.deltas import usage_dict
from services.gateway.http.sse import (
    SSE_DONE,
    chat_chunk,
    completion_chunk,
    error_chunk,
    sse_comment,
    sse_event,
    usage_chunk,
)
from tests.sse_events import parse_sse

RID, MODEL, CREATED, FP = "chatcmpl-abc", "SmolLM2-135M-Instruct", 1_700_000_000, "v1"


def test_sse_event_bytes() -> None:
    assert sse_event({"a": 1, "b": "é"}) == b'data: {"a":1,"b":"\xc3\xa9"}\n\n'
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_sse_comment_bytes() -> None:
    assert sse_comment("keep-alive") == b": keep-alive\n\n"
    assert sse_comment() == b":\n\n"
    assert sse_comment("a\nb") == b": a\n: b\n\n"


def test_chat_chunk_fields() -> None:
    chunk = chat_chunk(RID, MODEL, CREATED, {"role": "assistant", "content": "Hi"}, None, FP)
    assert list(chunk) == ["id", "object", "created", "model", "system_fingerprint", "choices"]
    assert chunk == {
        "id": RID,
        "object": "chat.completion.chunk",
        "created": CREATED,
        "model": MODEL,
        "system_fingerprint": FP,
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": "Hi"},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
    }
    final = chat_chunk(RID, MODEL, CREATED, {}, "stop", None, index=2)
    assert final["choices"] == [
        {"index": 2, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    ]
    assert final["system_fingerprint"] is None


def test_completion_chunk_fields() -> None:
    chunk = completion_chunk("cmpl-1", MODEL, CREATED, " world", "length", FP)
    assert chunk == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": CREATED,
        "model": MODEL,
        "system_fingerprint": FP,
        "choices": [{"index": 0, "text": " world", "logprobs": None, "finish_reason": "length"}],
    }


@pytest.mark.parametrize(
    ("kind", "obj"), [("chat", "chat.completion.chunk"), ("completion", "text_completion")]
)
def test_usage_chunk(kind: str, obj: str) -> None:
    usage = usage_dict(12, 5, 4)
    chunk = usage_chunk(kind, RID, MODEL, CREATED, usage, FP)  # type: ignore[arg-type]
    assert chunk["object"] == obj
    assert chunk["choices"] == []
    assert chunk["usage"] == {
        "prompt_tokens": 12,
        "completion_tokens": 5,
        "total_tokens": 17,
        "prompt_tokens_details": {"cached_tokens": 4},
    }


def test_error_chunk() -> None:
    assert error_chunk("worker crashed", "server_error", 503) == {
        "error": {"message": "worker crashed", "type": "server_error", "param": None, "code": 503}
    }


def test_parse_round_trip() -> None:
    chunks = [
        chat_chunk(RID, MODEL, CREATED, {"role": "assistant", "content": ""}, None, FP),
        chat_chunk(RID, MODEL, CREATED, {"content": "你好 🎉\n\ndata: x"}, None, FP),
        chat_chunk(RID, MODEL, CREATED, {}, "stop", FP),
        usage_chunk("chat", RID, MODEL, CREATED, usage_dict(3, 2, 0), FP),
    ]
    stream = sse_comment("keep-alive") + b"".join(map(sse_event, chunks)) + SSE_DONE
    assert parse_sse(stream) == [*chunks, "[DONE]"]


def test_parse_spec_details() -> None:
    # CRLF line ends, "data:" without a space, a multi-line data field, other fields ignored.
    stream = b'event: x\r\ndata:{"a":\r\ndata: 1}\r\n\r\n: ping\n\nid: 7\n\ndata: [DONE]\n\n'
    assert parse_sse(stream) == [{"a": 1}, "[DONE]"]


def test_event_payload_is_single_line() -> None:
    # orjson never emits raw newlines, so one event is always one data line.
    body = sse_event({"t": "a\nb\r\n"})
    assert body.count(b"\n") == 2 and orjson.loads(body[6:-2]) == {"t": "a\nb\r\n"}
