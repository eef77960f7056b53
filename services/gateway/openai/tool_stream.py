"""Tool calls taken out of a streamed choice as they are generated, as OpenAI streams them.

Text that cannot be part of a call goes on as content at once. A call is sent in pieces: as
soon as its name is complete, a delta with the call's index, id, type and name (arguments
""); then its arguments text in deltas as the model writes them; every piece is a `tool_calls`
delta that clients concatenate by index. What is streamed is what the model wrote (its
whitespace included), so the arguments parse to the same object as the whole answer's.

    hermes:  ...content <tool_call> {"name": "f", "arguments": {...}} </tool_call> content...
    json:    [ {"name": "f", "arguments": {...}}, {"name": "g", "arguments": {...}} ]
                         ^ head: name known -> id+name delta
                                              ^ arguments object, streamed until it closes

A call that does not start `{"name": "<known tool>", "arguments": {` (another key order, an
unknown tool, string arguments) is held whole and read at its end as tools.parse_output
reads a finished answer: a call, or text that stays content. Under the json parser a
stream that is not a call list is held to the end and read the same way.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import orjson

from services.gateway.openai.tools import OPEN_TAG, ToolCall, ToolPlan, parse_output

CLOSE_TAG = "</tool_call>"
_FIRST_KEY = re.compile(r'\s*\{\s*"((?:[^"\\]|\\.)*)"')
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:')


@dataclasses.dataclass
class Piece:
    """What a stream's text turned into: content to send and tool_calls deltas."""

    content: str = ""
    deltas: list[dict[str, Any]] = dataclasses.field(default_factory=list)


class ToolStream:
    """One streamed choice's text with its tool calls taken out (see the module doc)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.json = plan.parser == "json"
        self.mode = "seek" if self.json else "text"  # text seek head args tail block hold
        self.buf = ""  # text not decided yet
        self.text = ""  # everything fed (json: read whole when it is no call list)
        self.calls: list[tuple[str, str, list[str]]] = []  # (id, name, argument pieces)
        self.depth = 0  # of the arguments object being streamed
        self.in_string = self.escaped = False
        self.after_call = False  # hermes: whitespace after a call's close tag is dropped

    def feed(self, text: str) -> Piece:
        """The content and call deltas `text` makes sendable now."""
        self.buf += text
        self.text += text
        out = Piece()
        while self._step(out):
            pass
        return out

    def finish(self) -> tuple[Piece, list[ToolCall]]:
        """The rest, at the choice's end, and the calls it made (whole, for gRPC; their
        arguments compact, as a whole answer's)."""
        out = Piece()
        if self.mode == "hold" and self.calls:  # what follows streamed calls: content
            out.content = self.buf
        elif self.mode == "hold":
            content, calls = parse_output(self.text, self.plan)
            out.content = content or ""
            for call in calls:
                self._whole(call, out)
        elif self.mode in ("head", "block") and not self.json:
            content, calls = parse_output(OPEN_TAG + self.buf + CLOSE_TAG, self.plan)
            if calls:
                self._whole(calls[0], out)
            else:
                out.content = OPEN_TAG + self.buf
        elif self.mode == "text":
            out.content = self.buf
        self.buf = ""
        made = [ToolCall(name, _compact("".join(args)), id) for id, name, args in self.calls]
        return out, made

    @property
    def called(self) -> bool:
        return bool(self.calls)

    # --- one move of the state machine; False when it needs more text ---------------------
    def _step(self, out: Piece) -> bool:
        move: Callable[[Piece], bool] = getattr(self, "_" + self.mode)
        return move(out)

    def _text(self, out: Piece) -> bool:
        if self.after_call:
            self.buf = self.buf.lstrip()
            if not self.buf:
                return False
            self.after_call = False
        start = self.buf.find(OPEN_TAG)
        if start >= 0:
            out.content += self.buf[:start]
            self.buf, self.mode = self.buf[start + len(OPEN_TAG) :], "head"
            return True
        keep = _partial(self.buf, OPEN_TAG)  # a tail that may become the tag
        out.content += self.buf[: len(self.buf) - keep]
        self.buf = self.buf[len(self.buf) - keep :]
        return False

    def _seek(self, out: Piece) -> bool:  # json: before a call object, or after one
        rest = self.buf.lstrip()
        if rest[:1] in ("[", ","):
            self.buf = rest[1:]
            return True
        if rest[:1] == "{":
            self.buf, self.mode = rest, "head"
            return True
        if rest[:1] == "]" and self.calls:
            self.buf, self.mode = rest[1:], "done"
            return False
        if rest:
            self.mode = "hold"  # not a call list (or not only): read whole at the end
        return False

    def _head(self, out: Piece) -> bool:
        head = _HEAD.match(self.buf)
        if head is None:
            first = _FIRST_KEY.match(self.buf)
            lost = self.buf.lstrip()[:1] not in ("", "{") or (first and first[1] != "name")
            if lost or (not self.json and CLOSE_TAG in self.buf):
                self.mode = "hold" if self.json else "block"
                return not self.json
            return False
        if head[1] not in self.plan.tools:
            self.mode = "hold" if self.json else "block"
            return not self.json
        rest = self.buf[head.end() :].lstrip()
        if not rest:
            return False
        if rest[0] != "{":  # arguments as a string, say: read whole
            self.mode = "hold" if self.json else "block"
            return not self.json
        call_id = ToolCall(head[1], "").id
        index = len(self.calls)
        self.calls.append((call_id, head[1], []))
        function = {"name": head[1], "arguments": ""}
        out.deltas.append(
            {
                "tool_calls": [
                    {"index": index, "id": call_id, "type": "function", "function": function}
                ]
            }
        )
        self.buf, self.mode, self.depth = rest, "args", 0
        return True

    def _args(self, out: Piece) -> bool:
        end = self._scan()
        piece, self.buf = self.buf[:end], self.buf[end:]
        if piece:
            self.calls[-1][2].append(piece)
            index = len(self.calls) - 1
            out.deltas.append(_arguments_delta(index, piece))
        if self.depth == 0:
            self.mode = "tail"
            return True
        return False

    def _tail(self, out: Piece) -> bool:  # after the arguments: the call's end
        if self.json:
            close = self.buf.find("}")
            if close < 0:
                return False
            self.buf, self.mode = self.buf[close + 1 :], "seek"
            return True
        close = self.buf.find(CLOSE_TAG)
        if close < 0:
            return False
        self.buf, self.mode = self.buf[close + len(CLOSE_TAG) :], "text"
        self.after_call = True
        return True

    def _block(self, out: Piece) -> bool:  # hermes: a call read whole at its close tag
        close = self.buf.find(CLOSE_TAG)
        if close < 0:
            return False
        body, self.buf = self.buf[:close], self.buf[close + len(CLOSE_TAG) :]
        block = OPEN_TAG + body + CLOSE_TAG
        content, calls = parse_output(block, self.plan)
        if calls:
            self._whole(calls[0], out)
            self.after_call = True
        else:
            out.content += block
        self.mode = "text"
        return True

    def _hold(self, out: Piece) -> bool:
        return False

    def _done(self, out: Piece) -> bool:
        self.buf = ""
        return False

    def _scan(self) -> int:
        """How much of buf belongs to the arguments object (depth 0: it closed there)."""
        for i, ch in enumerate(self.buf):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return len(self.buf)

    def _whole(self, call: ToolCall, out: Piece) -> None:
        index = len(self.calls)
        self.calls.append((call.id, call.name, [call.arguments]))
        head = {"index": index, "id": call.id, "type": "function"}
        out.deltas.append(
            {"tool_calls": [head | {"function": {"name": call.name, "arguments": ""}}]}
        )
        out.deltas.append(
            {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]}
        )


def _compact(arguments: str) -> str:
    try:
        return orjson.dumps(orjson.loads(arguments)).decode()
    except orjson.JSONDecodeError:  # cut short (finish reason length): as written
        return arguments


def _head_delta(index: int, call_id: str, name: str) -> dict[str, Any]:
    function = {"name": name, "arguments": ""}
    return {
        "tool_calls": [{"index": index, "id": call_id, "type": "function", "function": function}]
    }


def _arguments_delta(index: int, text: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, "function": {"arguments": text}}]}


def _partial(text: str, tag: str) -> int:
    """How many characters at the end of `text` start `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0
