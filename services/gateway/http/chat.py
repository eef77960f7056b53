"""The /v1/chat/completions response: role chunks first, `delta` chunks, a `message` per
choice in the body (with tool calls read from the output when the request has tools), and
the response-level prompt logprobs vLLM puts beside the choices. vLLM's chat `echo` starts
every choice's content with the last message's text; with --reasoning-parser the thinking
goes to `reasoning_content` (services/gateway/openai/reasoning.py)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Literal

from services.gateway.http import sse
from services.gateway.http.deltas import Choice, Usage
from services.gateway.http.reply import Reply
from services.gateway.openai.reasoning import ReasoningStream, split_reasoning
from services.gateway.openai.tool_stream import ToolStream
from services.gateway.openai.tools import ToolPlan, chat_message


@dataclasses.dataclass(frozen=True, slots=True)
class ChatReply(Reply):
    """A chat completion's chunks and body."""

    kind: ClassVar[Literal["chat", "completion"]] = "chat"
    object_name: ClassVar[str] = "chat.completion"

    tools: ToolPlan | None = None  # with tools: tool calls are read from the output
    chat_echo: str = ""  # vLLM's chat `echo`: what every choice's content starts with
    reasoning: str = ""  # --reasoning-parser: its name (services/gateway/openai/reasoning.py)

    def head(self) -> list[bytes]:
        """The stream's role chunks, one per choice, before any text (then the echo)."""
        role = {"role": "assistant", "content": ""}
        events = [self._event(role, "", None, index) for index in range(self.n)]
        if self.chat_echo:
            events += [self.text(self.chat_echo, index) for index in range(self.n)]
        return events

    def tool_stream(self) -> ToolStream | None:
        return ToolStream(self.tools) if self.tools is not None else None

    def reasoning_stream(self) -> ReasoningStream | None:
        return ReasoningStream(self.reasoning) if self.reasoning else None

    def body(self, choices: list[Choice], usage: Usage, with_token_ids: bool) -> dict[str, Any]:
        out = Reply.body(self, choices, usage, with_token_ids)
        if self.lp is not None:  # vLLM: the response's prompt logprobs, for chat
            out |= self.lp.extra(0)
        return out

    def _chunk(
        self,
        delta: dict[str, Any],
        text: str,
        finish: str | None,
        index: int,
        logprobs: dict[str, Any] | None,
        extra: dict[str, Any] | None,
    ) -> dict[str, Any]:
        ids = (self.request_id, self.model, self.created)
        return sse.chat_chunk(*ids, delta, finish, self.fingerprint, index, logprobs, extra)

    def _choice(self, choice: Choice, with_token_ids: bool) -> dict[str, Any]:
        thought, text = (
            split_reasoning(choice.text, self.reasoning) if self.reasoning else (None, choice.text)
        )
        message, finish = chat_message(text, choice.finish_reason.openai, self.tools)
        if thought is not None:
            message["reasoning_content"] = thought
        if self.chat_echo:
            message["content"] = self.chat_echo + (message["content"] or "")
        out: dict[str, Any] = {"index": choice.index, "message": message}
        out |= {"logprobs": self._choice_logprobs(choice)}
        out |= self._finish_fields(choice, finish)
        if with_token_ids:
            out["token_ids"] = choice.token_ids
        return out
