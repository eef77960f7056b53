"""What one step of the policy decides: the requests it runs and how far, and the block
moves (swaps, copy-on-write) the worker makes before computing. plan.py turns it into the
StepPlan message."""

from __future__ import annotations

import dataclasses

from services.scheduler.kv_tiers import TierMoves
from services.scheduler.request import Request


@dataclasses.dataclass
class ScheduledReq:
    request: Request
    num_new_tokens: int
    new_block_ids: list[int]
    num_computed_tokens: int  # before this step
    samples: bool  # the step reaches the request's last known token and samples the next
    num_spec_tokens: int = 0  # draft slots after its token (speculative decoding)
    # layer groups (sliding windows): per group its new entries (PLACEHOLDER where a block
    # went back); new_block_ids is then the reference group's. None: one dense group
    new_group_block_ids: list[list[int]] | None = None


@dataclasses.dataclass
class SchedulerOutput:
    scheduled: list[ScheduledReq] = dataclasses.field(default_factory=list)
    new_requests: list[Request] = dataclasses.field(default_factory=list)
    finished_req_ids: list[str] = dataclasses.field(default_factory=list)
    preempted_req_ids: list[str] = dataclasses.field(default_factory=list)
    swap_out: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (gpu, host)
    swap_in: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (host, gpu)
    copies: list[tuple[str, int, int, int]] = dataclasses.field(default_factory=list)
    # copy-on-write: (request, index in its table, source block, new block)
    copy_groups: list[int] = dataclasses.field(default_factory=list)  # per copy, with groups
    tiers: TierMoves = dataclasses.field(default_factory=TierMoves)  # lower-tier moves

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens + s.num_spec_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return (
            not (self.scheduled or self.finished_req_ids or self.preempted_req_ids)
            and self.tiers.is_empty
        )
