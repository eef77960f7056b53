"""The /v1/completions response: `text` chunks and choices, with echo (the prompt before the
output) and the per-choice prompt logprobs vLLM adds."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Literal

from services.gateway.http import sse
from services.gateway.http.deltas import Choice
from services.gateway.http.reply import Reply


@dataclasses.dataclass(frozen=True, slots=True)
class CompletionReply(Reply):
    """A text completion's chunks and body."""

    kind: ClassVar[Literal["chat", "completion"]] = "completion"
    object_name: ClassVar[str] = "text_completion"

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
        return sse.completion_chunk(*ids, text, finish, self.fingerprint, index, logprobs, extra)

    def _choice(self, choice: Choice, with_token_ids: bool) -> dict[str, Any]:
        lp, i = self.lp, choice.index
        out: dict[str, Any] = {"index": i}
        out["text"] = (lp.echo_text(i) if lp is not None else "") + choice.text
        out |= {"logprobs": self._choice_logprobs(choice)}
        out |= self._finish_fields(choice, choice.finish_reason.openai)
        if lp is not None:
            out |= lp.extra(i)
        if with_token_ids:
            out["token_ids"] = choice.token_ids
        return out
