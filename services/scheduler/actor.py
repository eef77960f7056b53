"""The scheduler process: owns the queues and the KV block accounting; never touches tensors.

One step is in flight at a time: plan -> worker -> result -> plan. Messages that arrive while
the worker computes (new requests, aborts) are applied before the next plan.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from common.actor import Actor
from common.config import Config
from common.messages import (
    Abort,
    DetokNew,
    FinishReason,
    Ready,
    RequestError,
    Stats,
    StatsQuery,
    StepPlan,
    StepResult,
    TokenBatch,
    TokenizedRequest,
)
from services.scheduler.block_manager import BlockManager
from services.scheduler.policy import Scheduler, SchedulerOutput
from services.scheduler.request import Request

log = logging.getLogger(__name__)

_PROMPT_TAIL = 6  # prompt tokens the detokenizer needs to space the first output word


class SchedulerActor(Actor):
    name = "scheduler"

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.policy: Scheduler | None = None
        self.worker_info: dict[str, Any] = {}
        self.step_in_flight: int | None = None
        self.step_req_ids: list[str] = []
        self.step_started = 0.0
        self.num_steps = 0
        self.step_time_s = 0.0
        self.worker_time_s = 0.0
        self.handlers.update({
            TokenizedRequest: self._on_tokenized,
            StepResult: self._on_step_result,
            Abort: self._on_abort,
            StatsQuery: self._on_stats_query,
            Ready: self._on_ready,
        })

    async def start(self) -> None:
        self.worker = self.outbox(self.config.addr("worker"))
        self.detokenizer = self.outbox(self.config.addr("detokenizer"))
        self.gateway = self.outbox(self.config.addr("gateway"))
        assert self.inbox is not None
        while not self.worker_info:  # the worker's Ready sizes the block pool
            await self.dispatch(await self.inbox.recv())

    def ready_info(self) -> dict[str, Any]:
        return dict(self.worker_info)

    # handlers -----------------------------------------------------------------------------
    def _on_ready(self, msg: Ready) -> None:
        if msg.name != "worker":
            return
        info = msg.info
        if self.policy is not None:
            log.warning("worker re-announced itself; resetting the block pool")
        self.worker_info = info
        blocks = BlockManager(info["num_blocks"], info["block_size"])
        self.max_model_len = min(info["max_model_len"], info["num_blocks"] * info["block_size"])
        self.policy = Scheduler(
            blocks,
            max_num_seqs=self.config.scheduler.max_num_seqs,
            max_num_batched_tokens=self.config.scheduler.max_num_batched_tokens,
        )
        self.step_in_flight = None
        log.info("worker ready: %d blocks of %d tokens", info["num_blocks"], info["block_size"])

    def _on_tokenized(self, msg: TokenizedRequest) -> None:
        assert self.policy is not None
        if self.policy.num_waiting >= self.config.scheduler.max_waiting:
            self._reject(msg.request_id, 429, f"server overloaded: {self.policy.num_waiting} "
                         f"requests waiting (max_waiting={self.config.scheduler.max_waiting})")
            return
        total = len(msg.prompt_token_ids) + msg.sampling.max_tokens
        if len(msg.prompt_token_ids) >= self.max_model_len:
            self._reject(msg.request_id, 400, f"prompt has {len(msg.prompt_token_ids)} tokens; "
                         f"this server holds at most {self.max_model_len - 1}", "messages")
            return
        req = Request(msg.request_id, msg.prompt_token_ids, msg.sampling, msg.eos_token_ids,
                      max_model_len=self.max_model_len, arrival_time=msg.arrival_time)
        try:
            self.policy.add(req)
        except ValueError as e:
            self._reject(msg.request_id, 400, str(e), "X-Request-Id")
            return
        self.detokenizer.send(DetokNew(
            request_ids=[req.request_id], stop=[list(msg.sampling.stop)],
            num_prompt_tokens=[req.num_prompt_tokens],
            prompt_tails=[req.prompt_token_ids[-_PROMPT_TAIL:]]))
        log.debug("admitted %d + %d tokens", req.num_prompt_tokens, total - req.num_prompt_tokens,
                  extra={"request_id": req.request_id})

    def _on_abort(self, msg: Abort) -> None:
        assert self.policy is not None
        reason = FinishReason(msg.reason)
        aborted = [r for rid in msg.request_ids if (r := self.policy.abort(rid, reason))]
        if aborted:
            self.detokenizer.send(TokenBatch(
                request_ids=[r.request_id for r in aborted], token_ids=[[] for _ in aborted],
                finish_reasons=[int(reason)] * len(aborted)))

    def _on_step_result(self, msg: StepResult) -> None:
        assert self.policy is not None
        if msg.step_id != self.step_in_flight:
            log.warning("stale step result %d", msg.step_id)
            return
        self.step_in_flight = None
        if msg.error:
            log.error("step %d failed on the worker: %s", msg.step_id, msg.error)
            self._on_abort(Abort(request_ids=self.step_req_ids, reason=int(FinishReason.ERROR)))
            return
        self.num_steps += 1
        self.step_time_s += time.perf_counter() - self.step_started
        self.worker_time_s += msg.forward_s
        results = self.policy.update(msg.req_ids, msg.token_ids)
        if results:
            self.detokenizer.send(TokenBatch(
                request_ids=[r.request_id for r, _, _ in results],
                token_ids=[[t] for _, t, _ in results],
                finish_reasons=[int(f) for _, _, f in results]))

    def _on_stats_query(self, msg: StatsQuery) -> None:
        self.outbox(msg.reply_to).send(Stats(name=self.name, query_id=msg.query_id,
                                             data=self.stats()))

    # the step -----------------------------------------------------------------------------
    async def on_idle(self) -> None:
        policy = self.policy
        if policy is None or self.step_in_flight is not None or not policy.has_work():
            if policy is not None and self.step_in_flight is None and not policy.has_work():
                policy.check_integrity()
            return
        out = policy.schedule()
        if out.is_empty:
            return
        self.step_in_flight = self.num_steps
        self.step_started = time.perf_counter()
        self.step_req_ids = [s.request.request_id for s in out.scheduled]
        self.worker.send(_to_plan(self.step_in_flight, out))

    def _reject(self, request_id: str, status: int, message: str, param: str | None = None) -> None:
        log.info("rejected: %s", message, extra={"request_id": request_id})
        self.gateway.send(RequestError(request_id=request_id, status=status, message=message,
                                       param=param))

    def stats(self) -> dict[str, Any]:
        p = self.policy
        if p is None:
            return {"ready": False}
        return {
            "ready": True,
            "num_waiting": p.num_waiting,
            "num_running": p.num_running,
            "num_total_blocks": p.blocks.num_blocks,
            "num_free_blocks": p.blocks.num_free_blocks,
            "kv_cache_usage": p.blocks.usage,
            "num_preemptions": p.num_preemptions,
            "num_steps": self.num_steps,
            "num_computed_tokens": p.num_computed_tokens_total,
            "mean_step_s": self.step_time_s / max(1, self.num_steps),
            "mean_worker_s": self.worker_time_s / max(1, self.num_steps),
            "step_in_flight": self.step_in_flight is not None,
            "model": self.worker_info,
        }


def _to_plan(step_id: int, out: SchedulerOutput) -> StepPlan:
    return StepPlan(
        step_id=step_id,
        new_req_ids=[r.request_id for r in out.new_requests],
        new_prompt_token_ids=[r.prompt_token_ids for r in out.new_requests],
        new_sampling=[r.sampling for r in out.new_requests],
        finished_req_ids=out.finished_req_ids,
        preempted_req_ids=out.preempted_req_ids,
        req_ids=[s.request.request_id for s in out.scheduled],
        num_computed_tokens=[s.num_computed_tokens for s in out.scheduled],
        num_new_tokens=[s.num_new_tokens for s in out.scheduled],
        new_block_ids=[s.new_block_ids for s in out.scheduled],
    )
