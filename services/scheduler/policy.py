"""Continuous batching: what runs in the next step.

There is no prefill phase. Each request has `num_computed_tokens` and a target
(`num_tokens`: prompt plus what it has generated). A step fills a token budget
(`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`):

1. running requests first, oldest first: one token for a decode, a chunk of the rest of
   the prompt for a prefill (chunked prefill);
2. when a running request needs a block and none is free, the newest running request is
   preempted (its blocks freed, its tokens kept; it recomputes later from the waiting
   queue's head);
3. then waiting requests, first come first served, while the budget, the sequence cap and
   the free blocks (less a small watermark kept for running decodes) allow.

A request that finishes (EOS, length, stop string, abort) frees its blocks at once; the
worker is told to drop its state in the next plan.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from common.messages import FinishReason
from services.scheduler.block_manager import BlockManager
from services.scheduler.request import Request, Status


@dataclasses.dataclass
class ScheduledReq:
    request: Request
    num_new_tokens: int
    new_block_ids: list[int]
    num_computed_tokens: int  # before this step


@dataclasses.dataclass
class SchedulerOutput:
    scheduled: list[ScheduledReq]
    new_requests: list[Request]  # first time the worker sees them
    finished_req_ids: list[str]  # the worker drops these before the step
    preempted_req_ids: list[str]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.finished_req_ids or self.preempted_req_ids)


@dataclasses.dataclass
class Finished:
    request: Request
    reason: FinishReason


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        watermark: float = 0.01,
    ) -> None:
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.num_watermark_blocks = int(watermark * block_manager.num_blocks)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_for_worker: list[str] = []
        self.num_preemptions = 0
        self.num_computed_tokens_total = 0

    # queue changes ---------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id}")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, req_id: str, reason: FinishReason) -> Request | None:
        """Finish a request wherever it is; idempotent. Returns it if it was live."""
        req = self.requests.get(req_id)
        if req is None or req.is_finished:
            return None
        self._finish(req, reason)
        return req

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._finished_for_worker)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # the step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput([], [], self._finished_for_worker, [])
        self._finished_for_worker = []
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted_req_ids:
            self._schedule_waiting(out, budget)
        for s in out.scheduled:
            if not s.request.is_known_to_worker:
                s.request.is_known_to_worker = True
                out.new_requests.append(s.request)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens_to_compute, budget)
            if not self._reserve(req, req.num_computed_tokens + num_new, out):
                break  # req itself was preempted; everything after it too
            out.scheduled.append(self._take(req, num_new))
            budget -= num_new
            i += 1
        return budget

    def _reserve(self, req: Request, num_tokens: int, out: SchedulerOutput) -> bool:
        """Make room for req's blocks by preempting the newest running requests."""
        need = self.blocks.num_new_blocks(req.request_id, num_tokens)
        while not self.blocks.can_allocate(need):
            victim = self.running.pop()
            self._preempt(victim, out)
            if victim is req:
                return False
        return True

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            num_new = min(req.num_tokens_to_compute, budget)
            need = self.blocks.num_new_blocks(req.request_id, num_new)
            if not self.blocks.can_allocate(need, reserve=self.num_watermark_blocks):
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            out.scheduled.append(self._take(req, num_new))
            budget -= num_new

    def _take(self, req: Request, num_new: int) -> ScheduledReq:
        before = req.num_computed_tokens
        new_blocks = self.blocks.allocate(req.request_id, before + num_new)
        req.num_computed_tokens += num_new
        self.num_computed_tokens_total += num_new
        return ScheduledReq(req, num_new, new_blocks, before)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.blocks.free(req.request_id)
        req.num_computed_tokens = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        if req.is_known_to_worker:
            out.preempted_req_ids.append(req.request_id)

    # results ------------------------------------------------------------------------------
    def update(self, req_ids: list[str], token_ids: list[int]) -> list[tuple[Request, int, FinishReason]]:
        """Apply a step's sampled tokens; return (request, token, finish reason) for live ones."""
        results = []
        for req_id, token in zip(req_ids, token_ids, strict=True):
            req = self.requests.get(req_id)
            if req is None or req.is_finished or req.status != Status.RUNNING:
                continue  # aborted or preempted while the step ran: the token is dropped
            reason = req.append_token(token)
            if reason != FinishReason.NONE:
                self._finish(req, reason)
            results.append((req, token, reason))
        return results

    def _finish(self, req: Request, reason: FinishReason) -> None:
        if req.status == Status.RUNNING:
            self.running.remove(req)
        elif req.status == Status.WAITING:
            self.waiting.remove(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        self.blocks.free(req.request_id)
        del self.requests[req.request_id]
        if req.is_known_to_worker:
            self._finished_for_worker.append(req.request_id)

    def check_integrity(self) -> None:
        self.blocks.check_integrity()
        live = {r.request_id for r in self.running} | {r.request_id for r in self.waiting}
        assert live == set(self.requests), "a request is lost or in two queues"
        assert len(self.running) + len(self.waiting) == len(self.requests)
        for req_id in self.blocks.block_tables:
            assert req_id in self.requests, f"finished request {req_id} still holds blocks"
        for r in self.waiting:
            assert r.num_computed_tokens == 0 or r.request_id in self.blocks.block_tables
