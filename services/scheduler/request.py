"""The scheduler's record of one sequence (no tensors: the worker holds those)."""

from __future__ import annotations

import enum
import itertools
import time

from common.messages import FinishReason, SamplingParams

_arrivals = itertools.count()


class Status(enum.IntEnum):
    WAITING = 0  # new, or preempted (recompute: no KV; swap: KV in host memory)
    RUNNING = 1
    FINISHED = 2


class Request:
    """Tokens so far, how many are in the KV cache, and why it ends.

    There is no prefill phase: a request computes tokens until `num_computed_tokens`
    reaches `num_tokens`; the step that reaches it samples the next token. With overlapped
    scheduling that token is `pending` until its step's result arrives, but it already
    counts in `num_tokens`: the worker resolves it before the next step runs.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        eos_token_ids: list[int] | tuple[int, ...] = (),
        max_model_len: int = 1 << 30,
        arrival_time: float | None = None,
        *,
        cache_root: int = 0,
        cache_salt: str = "",
        lora_name: str = "",
        lora_hash: str = "",
        priority: int = 0,
        timeout: float | None = None,
        fork_of: Request | None = None,
        group_id: str | None = None,
        seq_index: int = 0,
    ) -> None:
        self.request_id = request_id  # the sequence's key (EngineCore's sequence_key)
        self.group_id = request_id if group_id is None else group_id  # the client's id
        self.seq_index = seq_index  # which of the request's n sequences
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling = sampling
        self.output_token_ids: list[int] = []
        self.num_pending = 0  # sampled in a step whose result has not arrived yet
        self.num_spec_in_flight = 0  # draft slots in the step in flight (speculative decoding)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache
        self.status = Status.WAITING
        self.finish_reason = FinishReason.NONE
        self.is_known_to_worker = False
        self.worker_has_table = False  # False when new or preempted: the next plan sends it all
        self.host_blocks: list[int] | None = None  # set while swapped out
        # KV layer groups: which entries of each group's table were blocks (False: a
        # sliding group had let it go) when it was swapped out, host_blocks in that order
        self.host_layout: list[list[bool]] | None = None
        self.tier_read_up = False  # its prefix was read up from disk once (admission.py)
        self.num_preemptions = 0
        self.scheduled_in = -1  # the last schedule() that gave it tokens
        self.computed_before_step = 0  # num_computed_tokens before that step
        self.cache_root = cache_root
        self.cache_salt = cache_salt  # salts the root it is hashed under when it starts
        self.lora_name = lora_name  # its LoRA adapter ("": the base model)
        self.lora_hash = lora_hash  # the adapter's weights hash (enters its cache root)
        self.version: str | None = None  # the model version, fixed when it first starts
        self.priority = priority
        self.arrival_seq = next(_arrivals)
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.deadline = None if timeout is None else self.arrival_time + timeout
        self.fork_of = fork_of  # n > 1: share this leader's prompt blocks once computed
        self.max_total_tokens = min(max_model_len, len(prompt_token_ids) + sampling.max_tokens)
        # a prefill replica's sequence stops at its first token and is handed over to a
        # decode replica, which goes on to this limit (None: not handed over)
        self.handover_limit: int | None = None
        # ... and the blocks it held when it finished there (its partial last block moves)
        self.handover_blocks: list[int] = []
        self.started_at = 0.0  # wall clock when it first started (its queue time ends)
        self._stop_ids = frozenset(sampling.stop_token_ids) | (
            frozenset() if sampling.ignore_eos else frozenset(eos_token_ids)
        )

    @property
    def stop_token_ids(self) -> list[int]:
        """The tokens that end it: its stop_token_ids, and EOS unless ignore_eos."""
        return sorted(self._stop_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_tokens_to_compute(self) -> int:
        """Tokens to compute next; 0 when every token it may still produce is spoken for (an
        embeddings request produces none: its prompt, up to the model's length, is all)."""
        if self.num_tokens >= self.max_total_tokens and not self.sampling.pooling:
            return 0
        return self.num_tokens - self.num_computed_tokens

    @property
    def all_token_ids(self) -> list[int]:
        """The known tokens (pending ones are not known yet)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED

    @property
    def is_swapped(self) -> bool:
        return self.host_blocks is not None

    def append_token(self, token_id: int) -> FinishReason:
        """Record a sampled token; return why the request is now finished, or NONE."""
        if self.num_pending:
            self.num_pending -= 1
        self.output_token_ids.append(token_id)
        if token_id in self._stop_ids:
            return FinishReason.STOP
        if len(self.prompt_token_ids) + len(self.output_token_ids) >= self.max_total_tokens:
            return FinishReason.LENGTH
        return FinishReason.NONE

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, "
            f"{self.num_computed_tokens}/{self.num_tokens})"
        )
