"""The scheduler's record of one request (no tensors: the worker holds those)."""

from __future__ import annotations

import enum
import time

from common.messages import FinishReason, SamplingParams


class Status(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


class Request:
    """Tokens so far, how many are in the KV cache, and why it ends.

    There is no prefill phase: a request computes tokens until `num_computed_tokens`
    reaches `num_tokens`; the step that reaches it samples the next token.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        eos_token_ids: list[int] | tuple[int, ...] = (),
        max_model_len: int = 1 << 30,
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling = sampling
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.status = Status.WAITING
        self.finish_reason = FinishReason.NONE
        self.is_known_to_worker = False
        self.num_preemptions = 0
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.max_total_tokens = min(max_model_len, len(prompt_token_ids) + sampling.max_tokens)
        self._stop_ids = frozenset(sampling.stop_token_ids) | (
            frozenset() if sampling.ignore_eos else frozenset(eos_token_ids)
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED

    def append_token(self, token_id: int) -> FinishReason:
        """Record a sampled token; return why the request is now finished, or NONE."""
        self.output_token_ids.append(token_id)
        if token_id in self._stop_ids:
            return FinishReason.STOP
        if self.num_tokens >= self.max_total_tokens:
            return FinishReason.LENGTH
        return FinishReason.NONE

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, "
                f"{self.num_computed_tokens}/{self.num_tokens})")
