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
    """What one request produced since the previous delta."""

    text: str
    token_ids: list[int]
    finish_reason: FinishReason  # NONE while running
    num_prompt_tokens: int
    num_output_tokens: int  # so far


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
        """Stream deltas until one carries a finish reason. Raises RequestFailed.

        Closing the iterator early (client gone) aborts the request in the engine.
        """
        ...

    async def abort(self, request_id: str) -> None: ...
