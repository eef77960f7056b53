"""Reasoning output (`--reasoning-parser`, vLLM's parsers of the same names): the text a
model writes between think tags is its reasoning, returned apart from the answer (chat:
`reasoning_content`, streamed as deltas of that name; Responses: a `reasoning` item).

    deepseek_r1   <think> is optional (the chat template often opens it in the prompt);
                  everything before </think> is reasoning, and an output with no </think>
                  is all reasoning (it was cut off while thinking)
    qwen3         reasoning only when the output has </think> (after an optional <think>);
                  otherwise it is all answer (thinking was switched off)

A stream is split as it comes (`ReasoningStream`): text that may be the start of a tag is
held back until the next delta says what it is.
"""

from __future__ import annotations

import dataclasses

PARSERS = ("deepseek_r1", "qwen3")
THINK_START, THINK_END = "<think>", "</think>"


def split_reasoning(text: str, parser: str) -> tuple[str | None, str]:
    """(reasoning, answer) of a whole output; reasoning None when there was none."""
    body = text.lstrip()
    body = body[len(THINK_START) :] if body.startswith(THINK_START) else text
    if THINK_END not in body:
        return (body, "") if parser == "deepseek_r1" else (None, text)
    reasoning, _, answer = body.partition(THINK_END)
    return reasoning, answer


@dataclasses.dataclass(slots=True)
class ReasoningStream:
    """One streamed choice's split: `feed` each text delta, get (reasoning, answer) deltas.

    deepseek_r1 streams reasoning from the first token. qwen3 cannot know whether it is
    thinking before it sees </think>; as vLLM's parser, it takes an output that starts
    with <think> as reasoning, and any other as answer."""

    parser: str
    _held: str = ""  # text that may be part of a tag
    _state: str = "start"  # start | thinking | answering

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        text, self._held = self._held + text, ""
        reasoning, answer = [], []
        while text:
            if self._state == "start":
                stripped = text.lstrip()
                if THINK_START.startswith(stripped) and not final and len(stripped) < 7:
                    self._held = text  # "<thi": wait
                    break
                if stripped.startswith(THINK_START):
                    text, self._state = stripped[len(THINK_START) :], "thinking"
                else:
                    self._state = "thinking" if self.parser == "deepseek_r1" else "answering"
                continue
            if self._state == "answering":
                answer.append(text)
                break
            head, sep, tail = text.partition(THINK_END)
            if sep:
                reasoning.append(head)
                text, self._state = tail, "answering"
                continue
            keep = 0 if final else _partial_tag(text, THINK_END)
            reasoning.append(text[: len(text) - keep])
            self._held = text[len(text) - keep :]
            break
        return "".join(reasoning), "".join(answer)


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
