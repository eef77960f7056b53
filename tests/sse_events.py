"""A reader of SSE byte streams, for tests: what a client sees of services/gateway/http/sse.py."""

from __future__ import annotations

from typing import Any

import orjson

from services.gateway.http.sse import DONE


def parse_sse(stream: bytes) -> list[dict[str, Any] | str]:
    """Split an SSE byte stream into its data payloads: dicts, or the string "[DONE]".

    Comments and fields other than `data` are skipped; several `data:` lines in one event
    are joined with newlines, as the SSE spec says.
    """
    text = stream.decode().replace("\r\n", "\n").replace("\r", "\n")
    events: list[dict[str, Any] | str] = []
    for block in text.split("\n\n"):
        data = [_field_value(line) for line in block.split("\n") if _is_data(line)]
        if not data:
            continue
        payload = "\n".join(data)
        events.append(DONE if payload == DONE else orjson.loads(payload))
    return events


def _is_data(line: str) -> bool:
    return line == "data" or line.startswith("data:")


def _field_value(line: str) -> str:
    # One optional space after the colon belongs to the framing, not the value.
    return line.removeprefix("data").removeprefix(":").removeprefix(" ")
