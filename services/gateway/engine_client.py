"""The gateway's view of the engine: submit a request, stream its outputs, abort it.

`ZmqEngineClient` (services/gateway/zmq_client.py) is the real one; the HTTP and gRPC
front ends see only this interface.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Protocol

from common.messages import FinishReason, GenerateRequest


@dataclasses.dataclass(frozen=True, slots=True)
class OutputDelta:
    """What one sequence of a request produced since its previous delta.

    A request with `n` > 1 streams the deltas of its n sequences interleaved, told apart by
    `index`; each sequence finishes once (its own `finish_reason`), and `last` marks the delta
    after which the request has nothing more to say (every sequence finished). For n = 1,
    `last` is simply `finish_reason != NONE`.
    """

    text: str
    token_ids: list[int]
    finish_reason: FinishReason  # NONE while this sequence runs
    num_prompt_tokens: int
    num_output_tokens: int  # of this sequence, so far
    last: bool  # the request's final delta: every sequence has finished
    index: int = 0  # which sequence, 0..n-1
    version: str = ""  # the model version serving it ("" until the scheduler says)


class RequestFailed(Exception):
    """The engine refused or failed a request; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


class EngineClient(Protocol):
    model_name: str  # the served model name (what /v1/models lists)
    system_fingerprint: str  # the served weights version
    max_model_len: int

    def is_ready(self) -> bool: ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[OutputDelta]:
        """Stream deltas until the one marked `last`. Raises RequestFailed.

        Closing the iterator early (client gone) aborts the request in the engine.
        """
        ...

    async def abort(self, request_id: str) -> None: ...
