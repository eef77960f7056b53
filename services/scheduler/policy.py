"""Continuous batching over a paged KV cache: what runs in the next step.

There is no prefill phase. Each request has `num_computed_tokens` and a target
(`num_tokens`: prompt, generated and pending tokens). A step fills a token budget
(`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`):

1. running requests first, in order: one token for a decode, a chunk of the rest of the
   prompt for a prefill (chunked prefill);
2. when a running request needs a block and none is free, a not-yet-scheduled running
   request is preempted (the newest, or the lowest priority): `recompute` frees its blocks
   and keeps its tokens; `swap` copies its blocks to host memory first;
3. then waiting requests (FCFS or by priority) while the batch policy admits them and the
   budget, the cap and the free blocks (the whole prompt, less prefix-cache hits, plus a
   small watermark) allow. A swapped request comes back by copying its blocks in; a fork
   (`n > 1`) shares its leader's prompt blocks.

A request that finishes (EOS, length, stop string, abort, timeout) frees its blocks at once;
the worker is told to drop its state in the next plan. Every block is reused only by a
later plan, and the worker runs plans in order, so a block freed while a step is in flight
is never overwritten before that step is done.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from common.messages import FinishReason
from services.scheduler.admission import admit
from services.scheduler.batching import BatchGate
from services.scheduler.block_manager import BlockManager, HostBlockPool
from services.scheduler.grouped_blocks import GroupedBlockManager
from services.scheduler.kv_tiers import TierIndex
from services.scheduler.lora_admission import AdmissionVerdict, LoraGate
from services.scheduler.policy_config import PolicyConfig
from services.scheduler.queues import WaitingQueue
from services.scheduler.request import Request, Status
from services.scheduler.step_output import ScheduledReq, SchedulerOutput

__all__ = ["PolicyConfig", "ScheduledReq", "SchedulerOutput", "SchedulingPolicy"]


class SchedulingPolicy:
    """What runs in the next step: the waiting and running queues over one block pool (the
    algorithm at the top of this file); a waiting request's first blocks come from
    admission.py."""

    def __init__(
        self,
        blocks: BlockManager | GroupedBlockManager,
        config: PolicyConfig = PolicyConfig(),
        host_pool: HostBlockPool | None = None,
        clock: Callable[[], float] = time.monotonic,
        tiers: TierIndex | None = None,
    ) -> None:
        if config.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"unknown preemption mode {config.preemption_mode!r}")
        if blocks.grouped and tiers is not None:
            raise ValueError(
                "the KV tiers (--kv-offload-memory, --kv-offload-dir) are not supported "
                "with sliding-window layer groups"
            )
        self.blocks = blocks
        self.config = config
        self.host_pool = host_pool or HostBlockPool(0)
        # the prefix cache's lower tiers (None: off); the block manager then records the
        # cached blocks it evicts, saved in the plan that evicts them
        self.tiers = tiers
        self.clock = clock
        self.num_watermark_blocks = int(config.watermark * blocks.num_blocks)
        self.gate = BatchGate(
            config.batch_policy,
            config.max_num_seqs,
            config.batch_window,
            config.static_batch_timeout,
        )
        self.waiting = WaitingQueue(config.scheduling_policy)
        self.lora_gate = LoraGate(config.max_loras)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._queued_at: dict[str, float] = {}
        self._finished_for_worker: list[str] = []
        self.num_preemptions = 0
        self.num_swaps = 0
        self.num_computed_tokens_total = 0
        self.num_schedules = 0
        # speculative decoding: verification rounds, drafts proposed, drafts accepted
        self.num_spec_rounds = self.num_draft_tokens = self.num_accepted_tokens = 0
        # hot swap: the version (and prefix-cache root) new requests start on; while
        # `paused`, only requests that already started (preempted ones) are admitted
        self.version = ""
        self.root: int | None = None
        self.paused = False

    # queue changes ---------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in flight")
        self.requests[req.request_id] = req
        self._queued_at[req.request_id] = self.clock()
        self.waiting.push(req)

    def abort(self, req_id: str, reason: FinishReason) -> Request | None:
        """Finish a request wherever it is; idempotent. Returns it if it was live."""
        req = self.requests.get(req_id)
        if req is None:
            return None
        self._finish(req, reason)
        return req

    def expire(self, now_wall: float | None = None) -> list[Request]:
        """Finish every request past its deadline (finish reason `timeout`)."""
        now_wall = time.time() if now_wall is None else now_wall
        late = [
            r for r in self.requests.values() if r.deadline is not None and r.deadline <= now_wall
        ]
        for req in late:
            self._finish(req, FinishReason.TIMEOUT)
        return late

    def set_version(self, version: str, root: int) -> None:
        """Requests that have not started yet will run on `version` (a hot swap)."""
        self.version, self.root = version, root

    def num_started_on(self, version: str | None = None) -> int:
        """Live requests that started on `version` (any version when None)."""
        return sum(
            1
            for r in self.requests.values()
            if r.version is not None and (version is None or r.version == version)
        )

    def has_work(self) -> bool:
        return (
            bool(self._finished_for_worker)
            or any(r.num_tokens_to_compute for r in self.running)
            or bool(self.waiting)
        )

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def _oldest_wait(self) -> float:
        return self.clock() - min(self._queued_at[r.request_id] for r in self.waiting)

    # the step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.num_schedules += 1
        out = SchedulerOutput(finished_req_ids=self._finished_for_worker)
        self._finished_for_worker = []
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted_req_ids and self.waiting:
            self._schedule_waiting(out, budget)
        for s in out.scheduled:
            if not s.request.is_known_to_worker:
                s.request.is_known_to_worker = True
                out.new_requests.append(s.request)
        if self.tiers is not None:
            for block, key, tokens in self.blocks.drain_evictions():
                self.tiers.save(block, key, tokens)
            out.tiers = self.tiers.end_plan()
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens_to_compute, budget)
            if num_new == 0 or req.num_spec_in_flight:
                i += 1  # (drafts in flight: its next input is known only from their result)
                continue
            spec = self._num_spec_tokens(req, num_new, budget)
            if not self._reserve(req, i, req.num_computed_tokens + num_new + spec, out):
                break  # req itself was preempted
            out.scheduled.append(self._take(req, num_new, out, spec))
            budget -= num_new + spec
            i += 1
        return budget

    def _num_spec_tokens(self, req: Request, num_new: int, budget: int) -> int:
        """Draft slots for a decode: up to k, never more than it may still produce less one
        (the step always yields one token beyond the accepted drafts), nor past the budget.
        None for a request with logits controls (the worker verifies drafts without them),
        logprobs (the worker reports them for sampled rows only) or a grammar."""
        k = self.config.num_speculative_tokens
        if not k or num_new != 1 or req.num_pending or not req.output_token_ids:
            return 0
        sampling = req.sampling
        if sampling.has_controls or sampling.wants_logprobs or sampling.is_structured:
            return 0  # (a grammar: drafts are not checked against it, so none are made)
        may_produce = req.max_total_tokens - req.num_tokens
        return max(0, min(k, may_produce - 1, budget - num_new))

    def _reserve(self, req: Request, index: int, num_tokens: int, out: SchedulerOutput) -> bool:
        """Make room for req's blocks by preempting running requests not yet scheduled."""
        if isinstance(self.blocks, GroupedBlockManager):  # what its windows no longer read
            self.blocks.release_out_of_window(req.request_id, req.num_computed_tokens)
        need = self.blocks.num_new_blocks(req.request_id, num_tokens)
        need += self.blocks.is_shared(req.request_id, req.num_computed_tokens)
        while not self.blocks.can_allocate(need):
            victim = self._pick_victim(index)
            self.running.remove(victim)
            self._preempt(victim, out)
            if victim is req:
                return False
        return True

    def _pick_victim(self, index: int) -> Request:
        """The newest (FCFS) or lowest-priority request among those not yet scheduled."""
        # (a request whose drafts are in flight keeps its blocks until their result)
        candidates = [r for r in self.running[index:] if not r.num_spec_in_flight]
        if self.config.scheduling_policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.arrival_seq))
        return candidates[-1]

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        table = self.blocks.block_tables.get(req.request_id, [])
        layout = None
        if isinstance(self.blocks, GroupedBlockManager):  # every group's blocks
            table, layout = self.blocks.layout(req.request_id)
        # a token still pending from the step in flight is fine: the copy-out runs after that
        # step on the worker, and the request is not scheduled again before its result
        swap = self.config.preemption_mode == "swap" and self.host_pool.can_allocate(len(table))
        if swap:
            host = self.host_pool.allocate(len(table))
            out.swap_out.extend(zip(table, host, strict=True))
            req.host_blocks, req.host_layout = host, layout
            self.num_swaps += 1
        else:
            req.num_computed_tokens = 0
            req.num_cached_tokens = 0
        self.blocks.free(req.request_id)
        req.worker_has_table = False
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(req)
        if req.is_known_to_worker:
            out.preempted_req_ids.append(req.request_id)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        allowed = self.gate.num_admissible(
            len(self.running), len(self.waiting), self._oldest_wait()
        )
        self.lora_gate.begin(self.running)
        i = 0  # (requests before i wait for an adapter slot: lora_admission.py)
        while i < len(self.waiting):
            req = self.waiting[i]
            if budget <= 0 or allowed <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if self.paused and req.version is None:
                break  # a drain: nothing new starts until the swap is done
            verdict = self.lora_gate.verdict(req)  # --max-loras
            if verdict == AdmissionVerdict.SKIP:
                i += 1
                continue
            num_new = 0 if verdict == AdmissionVerdict.STOP else admit(self, req, budget, out)
            if num_new == 0:
                break
            self.waiting.remove(req)
            self.lora_gate.started(req)
            self.gate.admitted()
            allowed -= 1
            req.status = Status.RUNNING
            self.running.append(req)
            out.scheduled.append(self._take(req, num_new, out))
            budget -= num_new

    def _take(
        self, req: Request, num_new: int, out: SchedulerOutput, spec: int = 0
    ) -> ScheduledReq:
        before = req.num_computed_tokens
        req.scheduled_in, req.computed_before_step = self.num_schedules, before
        bm, group_blocks = self.blocks, None
        if isinstance(bm, GroupedBlockManager):
            new_blocks, group_blocks = self._take_grouped(bm, req, before + num_new + spec, out)
        else:
            copy = bm.copy_on_write(req.request_id, before)
            if copy is not None:
                out.copies.append((req.request_id, *copy))
            table_len = len(bm.block_tables.get(req.request_id, ()))
            bm.allocate(req.request_id, before + num_new + spec)
            table = bm.block_tables[req.request_id]
            # the worker's table is empty for a new or preempted request: send all of it
            new_blocks = table[table_len:] if req.worker_has_table else list(table)
        req.num_spec_in_flight = spec
        req.worker_has_table = True
        req.num_computed_tokens += num_new
        self.num_computed_tokens_total += num_new
        # (an embeddings request samples nothing: the step answers its vector, see `pooled`)
        samples = req.num_computed_tokens == req.num_tokens and not req.sampling.pooling
        if samples:
            req.num_pending += 1  # its token counts from now on, known when the step ends
        known = len(req.prompt_token_ids) + len(req.output_token_ids)
        self.blocks.cache_full_blocks(
            req.request_id,
            req.cache_root,
            req.all_token_ids,
            min(req.num_computed_tokens, known),
            owner=req.lora_name,
        )
        return ScheduledReq(req, num_new, new_blocks, before, samples, spec, group_blocks)

    def _take_grouped(
        self, bm: GroupedBlockManager, req: Request, num_tokens: int, out: SchedulerOutput
    ) -> tuple[list[int], list[list[int]]]:
        """_take's block moves with layer groups: per group a copy-on-write and the new
        entries of its table (the whole table for a worker that has none)."""
        before = req.num_computed_tokens
        # a sliding group's blocks before the window of this step's first token go back to
        # the pool: no token this step or later reads them, and the steps that did read
        # them ran before this plan (the worker runs plans in order)
        bm.release_out_of_window(req.request_id, before)
        for group, index, src, dst in bm.copy_on_write(req.request_id, before):
            out.copies.append((req.request_id, index, src, dst))
            out.copy_groups.append(group)
        lengths = bm.table_lengths(req.request_id)
        bm.allocate(req.request_id, num_tokens)
        tables = bm.blocks_since(req.request_id, lengths if req.worker_has_table else None)
        return tables[bm.ref_group], tables

    # results ------------------------------------------------------------------------------
    def update(
        self,
        req_ids: list[str],
        token_ids: list[int],
        num_tokens: list[int] | None = None,
        num_proposed: list[int] | None = None,
    ) -> list[tuple[Request, list[int], FinishReason]]:
        """Apply a step's sampled tokens (`num_tokens[i]` of them for request i, one each
        when None); return (request, its tokens, finish reason) for live ones. A finished
        request's late tokens (a stop seen one step late, tokens after a stop) are dropped.

        Speculative decoding: request i proposed `num_proposed[i]` drafts and `num_tokens[i]
        - 1` of them were accepted; their KV is now computed, and the blocks only rejected
        drafts used are released (the worker cuts its table the same way)."""
        counts = num_tokens or [1] * len(req_ids)
        results, start = [], 0
        for i, (req_id, count) in enumerate(zip(req_ids, counts, strict=True)):
            tokens, start = token_ids[start : start + count], start + count
            req = self.requests.get(req_id)
            if req is None:
                continue
            if req.num_spec_in_flight:
                req.num_spec_in_flight = 0
                if req.status == Status.RUNNING:  # (else preempted: its KV went too)
                    req.num_computed_tokens += count - 1
                    self.blocks.trim(req_id, req.num_computed_tokens)
            if num_proposed and num_proposed[i]:
                self.num_spec_rounds += 1
                self.num_draft_tokens += num_proposed[i]
                self.num_accepted_tokens += count - 1
            kept, reason = [], FinishReason.NONE
            for token in tokens:
                kept.append(token)
                reason = req.append_token(token)
                if reason != FinishReason.NONE:
                    break
            if req.status == Status.RUNNING:
                self.blocks.cache_full_blocks(
                    req_id,
                    req.cache_root,
                    req.all_token_ids,
                    min(req.num_computed_tokens, len(req.all_token_ids)),
                    owner=req.lora_name,
                )
            if reason != FinishReason.NONE:
                self._finish(req, reason)
            results.append((req, kept, reason))
        return results

    def pooled(self, req_ids: list[str]) -> list[tuple[Request, list[int], FinishReason]]:
        """Embeddings requests whose prompt a step computed: each is done (finish reason
        STOP, no token) and its blocks are free at once; (request, [], STOP) for the live
        ones (an aborted one is gone already)."""
        results: list[tuple[Request, list[int], FinishReason]] = []
        for req_id in req_ids:
            req = self.requests.get(req_id)
            if req is not None:
                self._finish(req, FinishReason.STOP)
                results.append((req, [], FinishReason.STOP))
        return results

    def _finish(self, req: Request, reason: FinishReason) -> None:
        if req.status == Status.RUNNING:
            self.running.remove(req)
        elif req.status == Status.WAITING:
            self.waiting.remove(req)
        if req.host_blocks is not None:
            self.host_pool.free(req.host_blocks)
            req.host_blocks = req.host_layout = None
        req.status = Status.FINISHED
        req.finish_reason = reason
        if req.handover_limit is not None:  # (a prefill replica's: its blocks may move)
            req.handover_blocks = list(self.blocks.block_tables.get(req.request_id, ()))
        self.blocks.free(req.request_id)
        del self.requests[req.request_id]
        self._queued_at.pop(req.request_id, None)
        self.lora_gate.forget(req.request_id)
        if req.is_known_to_worker:
            self._finished_for_worker.append(req.request_id)

    def check_idle(self) -> None:
        """With no request live: every block free or cached, every host block free. O(1),
        cheap enough for every idle moment; check_integrity checks block by block."""
        assert not self.requests and not self.running and not self.waiting, "not idle"
        assert self.blocks.num_used_blocks == 0, f"{self.blocks.num_used_blocks} blocks leaked"
        assert not any(self.blocks.block_tables.values()), "a finished request holds blocks"
        assert self.host_pool.num_free_blocks == self.host_pool.num_blocks, "host blocks leaked"

    def check_integrity(self) -> None:
        self.blocks.check_integrity()
        if self.tiers is not None:
            self.tiers.check_integrity()
        self.host_pool.check_integrity(
            [b for r in self.waiting if r.host_blocks for b in r.host_blocks]
        )
        live = {r.request_id for r in self.running} | {r.request_id for r in self.waiting}
        assert live == set(self.requests), "a request is lost or in two queues"
        assert len(self.running) + len(self.waiting) == len(self.requests)
        for req_id in self.blocks.block_tables:
            assert req_id in self.requests, f"finished request {req_id} still holds blocks"
        for r in self.waiting:
            assert (
                r.request_id not in self.blocks.block_tables
                or not self.blocks.block_tables[r.request_id]
            ), f"waiting {r.request_id} holds blocks"
