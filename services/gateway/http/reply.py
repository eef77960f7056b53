"""What every chunk or body of one OpenAI response repeats, and the parts chat and
completions build alike: text, finish and usage chunks, logprobs and echo, the body's
envelope. Each endpoint's own shapes are its subclass's: services/gateway/http/chat.py
(role chunks, `message`, tool calls) and services/gateway/http/completions.py (`text`)."""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar, Literal

from common.messages import FinishReason
from services.gateway.engine.client import OutputDelta
from services.gateway.http import sse
from services.gateway.http.deltas import Choice, Usage
from services.gateway.openai.logprobs import ChoiceLogprobs, merge_completion
from services.gateway.openai.reasoning import ReasoningStream
from services.gateway.openai.tool_stream import ToolStream


@dataclasses.dataclass(frozen=True, slots=True)
class Reply(abc.ABC):
    """One response's ids and settings; builds its SSE events and its JSON body."""

    kind: ClassVar[Literal["chat", "completion"]]
    object_name: ClassVar[str]  # the non-streamed body's `object`

    request_id: str
    model: str
    created: int
    fingerprint: str
    n: int = 1  # choices (sequences) in the answer
    n_per_prompt: int = 1  # of them, per prompt of a batch (the request's `n`)
    lp: ChoiceLogprobs | None = None  # logprobs and echo, when asked
    live_usage: Usage | None = None  # continuous_usage_stats: the usage so far, every chunk

    def head(self) -> list[bytes]:
        """Events before any text (chat's role chunks)."""
        return []

    def tool_stream(self) -> ToolStream | None:
        """A choice's tool-call reader when tool calls are read from the output (chat)."""
        return None

    def reasoning_stream(self) -> ReasoningStream | None:
        """A choice's reasoning splitter with --reasoning-parser (chat)."""
        return None

    def reasoning_event(self, text: str, index: int) -> bytes:
        """A stream's reasoning delta (chat with --reasoning-parser)."""
        return self._event({"reasoning_content": text}, "", None, index)

    def text(
        self,
        text: str,
        index: int = 0,
        logprobs: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> bytes:
        return self._event({"content": text}, text, None, index, logprobs, extra)

    def delta(self, delta: OutputDelta, first: bool) -> list[bytes]:
        """A delta's chunks before its finish: with echo, the choice's prompt first (`first`
        delta of the choice); its text, with its tokens' logprobs when asked; the prompt's
        logprobs (prompt_logprobs) with the first chunk that can carry them."""
        lp, i = self.lp, delta.index
        if lp is None:
            return [self.text(delta.text, i)] if delta.text else []
        out = []
        lp.see_prompt(i, delta.prompt_logprobs)
        extra = lp.stream_extra(i)
        if first and lp.echo_texts is not None:
            out.append(self.text(lp.echo_text(i), i, lp.echo(i), extra))
            extra = {}
        if lp.is_on and delta.logprobs:
            return [*out, self.text(delta.text, i, lp.tokens(i, delta.logprobs), extra)]
        if delta.text or extra:
            out.append(self.text(delta.text, i, None, extra))
        return out

    def finish(
        self,
        reason: FinishReason,
        index: int = 0,
        called: bool = False,
        stop_reason: str | int | None = None,
    ) -> bytes:
        finish = "tool_calls" if called and reason == FinishReason.STOP else reason.openai
        return self._event({}, "", finish, index, stop_reason=stop_reason)

    def call_events(self, deltas: list[dict[str, Any]], index: int) -> list[bytes]:
        """A streamed choice's tool_calls deltas (services/gateway/openai/tool_stream.py)."""
        return [self._event(d, "", None, index) for d in deltas]

    def tool_events(self, stream: ToolStream, index: int) -> tuple[list[bytes], bool]:
        """A streamed choice's held-back text at its finish: content, then the calls' rest."""
        piece, _ = stream.finish()
        events = [self.text(piece.content, index)] if piece.content else []
        return events + self.call_events(piece.deltas, index), stream.called

    def usage(self, usage: Usage) -> bytes:
        ids = (self.request_id, self.model, self.created)
        return sse.sse_event(sse.usage_chunk(self.kind, *ids, usage.as_dict(), self.fingerprint))

    def body(self, choices: list[Choice], usage: Usage, with_token_ids: bool) -> dict[str, Any]:
        """The non-streamed answer (with the output token ids when asked for)."""
        return {
            "id": self.request_id,
            "object": self.object_name,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": [self._choice(c, with_token_ids) for c in choices],
            "usage": usage.as_dict(),
        }

    @staticmethod
    def _finish_fields(choice: Choice, finish: str | None) -> dict[str, Any]:
        """A body choice's finish_reason, and vLLM's stop_reason beside it (the stop string
        or token id; null there, left out here)."""
        out: dict[str, Any] = {"finish_reason": finish}
        if choice.stop_reason is not None:
            out["stop_reason"] = choice.stop_reason
        return out

    def _choice_logprobs(self, choice: Choice) -> Any:
        lp, i = self.lp, choice.index
        if lp is None:
            return None
        if lp.echo_texts is not None:  # (echo's text offsets come first)
            return merge_completion(lp.echo(i), lp.tokens(i, choice.logprobs))
        return lp.tokens(i, choice.logprobs)

    def _event(
        self,
        delta: dict[str, Any],
        text: str,
        finish: str | None,
        index: int,
        logprobs: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
        stop_reason: str | int | None = None,
    ) -> bytes:
        """One SSE chunk: the endpoint's shape, with vLLM's stop_reason beside a finish
        (null: left out) and, with continuous usage stats, the usage so far."""
        chunk = self._chunk(delta, text, finish, index, logprobs, extra)
        if stop_reason is not None:
            chunk["choices"][0]["stop_reason"] = stop_reason
        if self.live_usage is not None:
            chunk["usage"] = self.live_usage.as_dict()
        return sse.sse_event(chunk)

    @abc.abstractmethod
    def _chunk(
        self,
        delta: dict[str, Any],
        text: str,
        finish: str | None,
        index: int,
        logprobs: dict[str, Any] | None,
        extra: dict[str, Any] | None,
    ) -> dict[str, Any]:
        """One stream chunk of this endpoint's shape (chat `delta`, completions `text`)."""

    @abc.abstractmethod
    def _choice(self, choice: Choice, with_token_ids: bool) -> dict[str, Any]:
        """One choice of the non-streamed body."""
