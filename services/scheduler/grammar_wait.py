"""Requests waiting for their grammar (structured outputs), held out of the policy's queues.

A constrained request is admitted (its sequences exist, the detokenizer knows them) but is
not queued until the worker has compiled its grammar (CompileGrammar -> GrammarCompiled):
the policy never sees it, so no step is planned around it and none waits for a compile
(vLLM holds such requests in WAITING_FOR_FSM the same way). Ending one while it waits
(abort, failure, a tokenizer change) finishes its sequences here; they never held blocks.
"""

from __future__ import annotations

from common.messages import FinishReason
from services.scheduler.request import Request, Status


class GrammarWait:
    """Sequences by request id, waiting for their grammar."""

    def __init__(self) -> None:
        self._waiting: dict[str, list[Request]] = {}
        self._tokenizers: dict[str, str] = {}  # request id -> the tokenizer it waits for

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waiting

    def park(self, request_id: str, seqs: list[Request], tokenizer_fingerprint: str) -> None:
        self._waiting[request_id] = list(seqs)
        self._tokenizers[request_id] = tokenizer_fingerprint

    def release(self, request_id: str, tokenizer_fingerprint: str) -> list[Request]:
        """The sequences still live once the grammar for that tokenizer is there ([]: ended
        meanwhile, or waiting for another tokenizer's: an answer for an earlier try)."""
        if self._tokenizers.get(request_id) != tokenizer_fingerprint:
            return []
        del self._tokenizers[request_id]
        return self._waiting.pop(request_id, [])

    def end(
        self, request_id: str, reason: FinishReason, seq_index: int | None = None
    ) -> list[Request]:
        """Finish a waiting request's sequences (or one of them); returns those ended."""
        seqs = self._waiting.get(request_id, [])
        ended = [r for r in seqs if seq_index is None or r.seq_index == seq_index]
        for req in ended:
            req.status, req.finish_reason = Status.FINISHED, reason
        left = [r for r in seqs if r not in ended]
        if left:
            self._waiting[request_id] = left
        else:
            self._waiting.pop(request_id, None)
            self._tokenizers.pop(request_id, None)
        return ended

    def expire(self, now_wall: float) -> list[Request]:
        """Finish the waiting sequences past their deadline (a compile that takes too long)."""
        late = [
            (r.group_id, r.seq_index)
            for seqs in self._waiting.values()
            for r in seqs
            if r.deadline is not None and r.deadline <= now_wall
        ]
        return [r for rid, i in late for r in self.end(rid, FinishReason.TIMEOUT, i)]

    def end_all(self, reason: FinishReason) -> list[Request]:
        return [r for rid in list(self._waiting) for r in self.end(rid, reason)]
