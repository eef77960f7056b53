"""One in-flight request on the gateway's engine client: its queue of deltas, which of its
sequences still run, and what it takes to send it again when a process behind the gateway
dies (a resume).

A resume sends the request to a tokenizer again as a new *attempt*, under a new wire id,
with the output token ids the client already has (`GenerateRequest.resumed_token_ids`):
the scheduler recomputes prompt + those tokens (as after a preemption by recompute), the
worker advances a seeded generator past them, the detokenizer decodes them silently, and
the stream goes on where it stopped. The wire id is new so that nothing an earlier attempt
left behind (late outputs, a request a dying tokenizer had already passed on) can mix into
the stream: outputs and errors are looked up by the current wire id only, and the earlier
one is aborted.

    client id "abc" ─ attempt 0: wire id "abc"           ─ lost (a process died)
                    └ attempt 1: wire id "abc/resume-1"  ─ streams on from token k

With several gateway processes every wire id also names the gateway that sends it
("g1:abc/resume-1", common/wire_id.py), so its outputs come back to that gateway.
"""

from __future__ import annotations

import asyncio
import dataclasses

from common.messages import FinishReason, GenerateRequest, OutputBatch
from common.wire_id import wire_id
from services.gateway.engine.client import OutputDelta, RequestFailed, entries


def resume_id(request_id: str, attempt: int) -> str:
    """The id of a request's `attempt` (0: the client's id), before the gateway's mark.
    Built here only, never parsed: the engine client maps wire ids to streams."""
    return request_id if attempt == 0 else f"{request_id}/resume-{attempt}"


@dataclasses.dataclass(frozen=True, slots=True)
class WireIds:
    """Which gateway process sends the requests: `index` of `num_gateways`."""

    index: int = 0
    num_gateways: int = 1

    def wire_id(self, request_id: str, attempt: int = 0) -> str:
        return wire_id(self.index, self.num_gateways, resume_id(request_id, attempt))


ONE_GATEWAY = WireIds()  # (the only gateway process: wire ids are the clients' ids)


def _with_id(request: GenerateRequest, request_id: str) -> GenerateRequest:
    return dataclasses.replace(request, request_id=request_id)


class Stream:
    """One in-flight request: the request as the client sent it, its queue, which of its
    sequences are still running, and its resume state."""

    def __init__(self, request: GenerateRequest, wire_ids: WireIds = ONE_GATEWAY) -> None:
        self.request = request  # as the client sent it
        self.wire_ids = wire_ids
        # what went to a tokenizer last (under its attempt's wire id)
        wire = wire_ids.wire_id(request.request_id)
        self.sent = request if wire == request.request_id else _with_id(request, wire)
        self.queue: asyncio.Queue[OutputDelta | RequestFailed] = asyncio.Queue()
        self.running = set(range(request.sampling.n))
        self.has_output = False
        self.attempt_has_output = False  # the attempt sent last has streamed something
        self.num_retokenized = 0
        self.attempt = 0
        self.token_ids: list[int] = []  # sequence 0's output token ids so far
        self.num_prompt_tokens = 0
        self.num_cached_tokens: int | None = None  # as the first prefill found them
        self.lost_at: float | None = None  # (loop time) lost to a process's death, not resent

    @property
    def wire_id(self) -> str:
        return self.sent.request_id

    @property
    def is_lost(self) -> bool:
        return self.lost_at is not None

    @property
    def is_resumable(self) -> bool:
        """Whether it can be sent again: one with no output yet as it was; one with output
        only with one sequence, no grammar (its matcher would start over) and no pooling."""
        sampling = self.request.sampling
        if not self.has_output:
            return True
        return sampling.n == 1 and not sampling.is_structured and not sampling.pooling

    def next_attempt(self) -> GenerateRequest:
        """The request to send now: a new wire id, the outputs the client has; no more
        prompt logprobs once they went out with the first delta."""
        self.attempt += 1
        self.lost_at = None
        self.attempt_has_output = False
        sampling = self.request.sampling
        if self.has_output and sampling.prompt_logprobs is not None:
            sampling = dataclasses.replace(sampling, prompt_logprobs=None)
        self.sent = dataclasses.replace(
            self.request,
            request_id=self.wire_ids.wire_id(self.request.request_id, self.attempt),
            sampling=sampling,
            resumed_token_ids=list(self.token_ids),
        )
        return self.sent

    def cancelled(self) -> OutputDelta:
        """The final delta of a lost request cancelled before it could be resent."""
        self.running.clear()
        return OutputDelta(
            text="",
            token_ids=[],
            finish_reason=FinishReason.CANCELLED,
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=len(self.token_ids),
            last=True,
        )

    def put(self, msg: OutputBatch, i: int, index: int) -> None:
        finish = FinishReason(msg.finish_reasons[i])
        self.has_output = self.attempt_has_output = True
        self.num_prompt_tokens = msg.num_prompt_tokens[i]
        if self.num_cached_tokens is None:  # a preempted or resumed prefill keeps the first
            self.num_cached_tokens = msg.num_cached_tokens[i] if msg.num_cached_tokens else 0
        if index == 0:
            self.token_ids.extend(msg.token_ids[i])
        if finish != FinishReason.NONE:
            self.running.discard(index)
        self.queue.put_nowait(
            OutputDelta(
                text=msg.texts[i],
                token_ids=msg.token_ids[i],
                finish_reason=finish,
                num_prompt_tokens=msg.num_prompt_tokens[i],
                num_output_tokens=msg.num_output_tokens[i],
                num_cached_tokens=self.num_cached_tokens,
                last=not self.running,
                index=index,
                version=msg.versions[i] if msg.versions else "",
                stop_reason=msg.stop_reasons[i] if msg.stop_reasons else None,
                logprobs=(
                    entries(msg.logprob_token_ids[i], msg.logprob_values[i], msg.logprob_tokens[i])
                    if msg.logprob_token_ids
                    else []
                ),
                prompt_logprobs=(
                    entries(
                        msg.prompt_logprob_token_ids[i],
                        msg.prompt_logprob_values[i],
                        msg.prompt_logprob_tokens[i],
                        msg.prompt_logprob_ranks[i] if msg.prompt_logprob_ranks else None,
                    )
                    if msg.prompt_logprob_token_ids
                    else []
                ),
                embedding=msg.embeddings[i] if msg.embeddings else [],
            )
        )
