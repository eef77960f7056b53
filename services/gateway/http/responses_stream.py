"""A streamed response (`stream: true`): OpenAI's typed events, numbered by
`sequence_number` (see services/gateway/http/responses.py for their order). Text streams as it
is generated; with --reasoning-parser the reasoning item streams first, then the message
(the split is made as the text comes, services/gateway/openai/reasoning.py). With tools the output
is read whole first (a call is known only once its text is complete), then its items are
sent."""

from __future__ import annotations

import itertools
from collections.abc import AsyncGenerator
from typing import Any, Protocol

from common.messages import FinishReason
from services.gateway.engine.client import OutputDelta, RequestFailed
from services.gateway.http import sse
from services.gateway.http.deltas import DeltaReader, Usage, close_shielded
from services.gateway.http.streaming import KEEPALIVE_S
from services.gateway.openai.reasoning import ReasoningStream
from services.gateway.openai.responses_items import (
    close_events,
    delta_event,
    item_events,
    message_item,
    open_events,
    reasoning_item,
)
from services.gateway.openai.tools import ToolPlan


class Turn(Protocol):
    """What a stream needs of the response being made (responses.py's _Turn)."""

    plan: ToolPlan | None
    reasoning: str

    def response(self, status: str = "in_progress", **fields: Any) -> dict[str, Any]: ...

    def items(self, text: str, reason: FinishReason) -> list[dict[str, Any]]: ...

    def finish(
        self, items: list[dict[str, Any]], reason: FinishReason, usage: Usage
    ) -> dict[str, Any]: ...


class _LiveItems:
    """The items of a stream sent as its text comes: a reasoning item while the model
    thinks (with a reasoning parser), then the message; each opened at its first text."""

    def __init__(self, parser: str) -> None:
        self.split = ReasoningStream(parser) if parser else None
        self.open: list[dict[str, Any]] = []  # items opened, in order (the last may be open)
        self.texts: list[list[str]] = []
        self.is_closed = False

    def feed(self, text: str, final: bool) -> list[dict[str, Any]]:
        thought, answer = self.split.feed(text, final) if self.split else ("", text)
        out = self._add("reasoning", thought) if thought else []
        return out + (self._add("message", answer) if answer else [])

    def close(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The last events and every item, whole (a message, even an empty one, last)."""
        out = [] if self.open and self.open[-1]["type"] == "message" else self._add("message", "")
        index = len(self.open) - 1
        out += close_events(index, self._whole(index))
        return out, [self._whole(i) for i in range(len(self.open))]

    def _add(self, kind: str, text: str) -> list[dict[str, Any]]:
        out = []
        if not self.open or self.open[-1]["type"] != kind:
            if self.open:  # the reasoning ends where the message starts
                out += close_events(len(self.open) - 1, self._whole(len(self.open) - 1))
            item = message_item("", "in_progress") if kind == "message" else reasoning_item("")
            self.open.append(item)
            self.texts.append([])
            out += open_events(len(self.open) - 1, item)
        index = len(self.open) - 1
        self.texts[index].append(text)
        if text:
            out.append(delta_event(index, self.open[index], text))
        return out

    def _whole(self, index: int) -> dict[str, Any]:
        item, text = self.open[index], "".join(self.texts[index])
        if item["type"] == "message":
            return message_item(text, item_id=item["id"])
        return reasoning_item(text) | {"id": item["id"]}


async def stream_events(
    reader: DeltaReader, first: OutputDelta, turn: Turn
) -> AsyncGenerator[bytes, None]:
    """The SSE body; a failure after the first byte is an `error` event."""
    numbers = itertools.count()

    def event(kind: str, **fields: Any) -> bytes:
        return sse.sse_event({"type": kind, "sequence_number": next(numbers)} | fields)

    try:
        yield event("response.created", response=turn.response())
        yield event("response.in_progress", response=turn.response())
        usage, text, reason = Usage(1), [], FinishReason.NONE
        live = _LiveItems(turn.reasoning) if turn.plan is None else None
        delta = first
        while True:
            usage.add(delta)
            text.append(delta.text)
            reason = delta.finish_reason if delta.finish_reason != FinishReason.NONE else reason
            for out in live.feed(delta.text, delta.last) if live else []:
                yield event(**out)
            if delta.last:
                break
            while True:
                try:
                    delta = await reader.next(KEEPALIVE_S)
                    break
                except TimeoutError:
                    yield sse.sse_comment("keep-alive")
        if live is not None:
            last, items = live.close()
        else:
            items = turn.items("".join(text), reason)
            last = [out for index, item in enumerate(items) for out in item_events(index, item)]
        for out in last:
            yield event(**out)
        response = turn.finish(items, reason, usage)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        yield event(kind, response=response)
    except RequestFailed as e:
        yield event("error", code=str(e.status), message=e.message, param=e.param)
    finally:
        await close_shielded(reader)
