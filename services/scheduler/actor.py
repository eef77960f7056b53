"""The scheduler process: owns the queues and the KV block accounting; never touches tensors.

Up to two steps are in flight with `--async-scheduling` (one without): step N+1 is planned
and sent while the worker computes step N; its decode inputs are the tokens step N samples,
resolved on the worker. Messages that arrive meanwhile (new requests, aborts) are applied
before the next plan. A stop seen one step late costs one discarded token, nothing more.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from typing import Any

from common.actor import Actor
from common.config import Config
from common.messages import (
    Abort,
    DetokNew,
    FinishReason,
    ModelLoaded,
    ProcessDown,
    Ready,
    RequestError,
    Reset,
    Stats,
    StatsQuery,
    StepResult,
    SwapModel,
    SwapResult,
    TokenBatch,
    TokenizedRequest,
)
from common.model_facts import cache_root
from services.scheduler.block_manager import BlockManager, HostBlockPool
from services.scheduler.plan import to_plan
from services.scheduler.policy import PolicyConfig, Scheduler
from services.scheduler.request import Request, Status
from services.scheduler.swap import SwapCoordinator

log = logging.getLogger(__name__)

_PROMPT_TAIL = 6  # prompt tokens the detokenizer needs to space the first output word
_TICK_S = 0.05  # how often deadlines and batch windows are looked at


@dataclasses.dataclass
class _InFlight:
    step_id: int
    req_ids: list[str]
    sent_at: float


class SchedulerActor(Actor):
    name = "scheduler"

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.policy: Scheduler | None = None
        self.worker_info: dict[str, Any] = {}
        self.in_flight: deque[_InFlight] = deque()
        # speculative decoding needs each step's result (how many drafts were accepted)
        # before its requests can be planned again: no overlap then
        self.max_in_flight = (2 if config.scheduler.async_scheduling
                              and not config.speculative.num_tokens else 1)
        self.groups: dict[str, list[str]] = {}  # n > 1: request id -> its sequences' ids
        self.num_steps = 0
        self.step_counter = 0
        self.step_time_s = 0.0
        self.worker_time_s = 0.0
        # result-to-result intervals of back-to-back steps, against the worker's own time
        self.interval_s = self.interval_forward_s = self._last_result_at = 0.0
        self.num_intervals = 0
        self._busy_since_last_result = False
        self._checked_at, self._checked_at_step = 0.0, -1  # the last block-by-block check
        self.handlers.update({
            TokenizedRequest: self._on_tokenized,
            StepResult: self._on_step_result,
            Abort: self._on_abort,
            StatsQuery: self._on_stats_query,
            Ready: self._on_ready,
            SwapModel: self._on_swap_model,
            ModelLoaded: self._on_model_loaded,
            ProcessDown: self._on_process_down,
        })
        self.swaps = SwapCoordinator(lambda m: self.worker.send(m),
                                     lambda to, m: self.outbox(to).send(m))

    async def start(self) -> None:
        self.worker = self.outbox(self.config.addr("worker"))
        self.detokenizer = self.outbox(self.config.addr("detokenizer"))
        self.gateway = self.outbox(self.config.addr("gateway"))
        assert self.inbox is not None
        # a restarted scheduler finds the worker running: ask it to start over and re-announce
        self.worker.send(Reset(reason="scheduler started"))
        while not self.worker_info:  # the worker's Ready sizes the block pool
            await self.dispatch(await self.inbox.recv())
        self.ticker = asyncio.create_task(self._tick())

    async def stop(self) -> None:
        if hasattr(self, "ticker"):
            self.ticker.cancel()

    def ready_info(self) -> dict[str, Any]:
        return dict(self.worker_info)

    # handlers -----------------------------------------------------------------------------
    def _on_ready(self, msg: Ready) -> None:
        if msg.name != "worker":
            return
        info, s = msg.info, self.config.scheduler
        if self.policy is not None:
            same = info.get("boot_id") == self.worker_info.get("boot_id")
            if same and not self.policy.requests and not self.in_flight:
                return  # the answer to our own Reset at start-up: nothing changed
            log.warning("worker re-announced itself; resetting the block pool")
            self._fail_all("the worker restarted")
        blocks = BlockManager(info["num_blocks"], info["block_size"],
                              enable_prefix_caching=self.config.cache.enable_prefix_caching)
        self.policy = Scheduler(blocks, PolicyConfig(
            max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
            scheduling_policy=s.scheduling_policy, preemption_mode=s.preemption_mode,
            batch_policy=s.batch_policy, batch_window=s.batch_window,
            static_batch_timeout=s.static_batch_timeout,
            num_speculative_tokens=self.config.speculative.num_tokens),
            host_pool=HostBlockPool(info.get("num_host_blocks", 0)))
        self._adopt(info)
        self.in_flight.clear()
        log.info("worker ready: %d blocks of %d tokens", info["num_blocks"], info["block_size"])

    def _adopt(self, info: dict[str, Any]) -> None:
        """Serve the model `info` describes: new requests start on its version and root."""
        assert self.policy is not None
        old = self.worker_info
        self.worker_info = {**info, "model_name": old.get("model_name", info.get("model_name"))}
        blocks = self.policy.blocks
        if (info["num_blocks"], info["block_size"]) != (blocks.num_blocks, blocks.block_size):
            # a drain swap to another KV layout: nothing holds blocks now, rebuild the pool
            assert blocks.num_used_blocks == 0, "pool rebuilt while blocks are in use"
            self.policy.blocks = BlockManager(
                info["num_blocks"], info["block_size"],
                enable_prefix_caching=self.config.cache.enable_prefix_caching)
        self.max_model_len = min(info["max_model_len"], info["num_blocks"] * info["block_size"])
        self.cache_root = cache_root(self.worker_info["model_name"], info["weights_version"],
                                     info.get("tokenizer_fingerprint", ""),
                                     info.get("position_config", ""))
        self.policy.set_version(info["weights_version"], self.cache_root)

    def _on_process_down(self, msg: ProcessDown) -> None:
        """A peer died: its requests cannot finish. Fail them all with a retryable error and
        free their blocks; a new worker announces itself with Ready (a new pool)."""
        if msg.name in ("worker", "detokenizer", "gateway"):
            log.error("%s died (exit %d): failing the requests in flight", msg.name,
                      msg.exit_code)
            self._fail_all(f"the {msg.name} process restarted")
            if msg.name == "worker":  # not ready until the new worker's Ready
                self.in_flight.clear()
                self.policy = None
                self.worker_info = {}

    def _fail_all(self, why: str) -> None:
        """Every live request ends: the gateway answers 503 (retry), the detokenizer drops it."""
        if self.policy is not None:
            self._fail(list(self.policy.requests.values()), 503,
                       f"{why}; the request was not completed, retry it")
            self.groups.clear()

    def _fail(self, reqs: list[Request], status: int, why: str) -> None:
        """End requests with an error: one RequestError per request to the gateway (the
        only path that tells it), and an ERROR finish so the detokenizer forgets them."""
        assert self.policy is not None
        for req in reqs:
            self.policy.abort(req.request_id, FinishReason.ERROR)
        for rid in sorted({r.request_id.rpartition("#")[0] or r.request_id for r in reqs}):
            self._reject(rid, status, why)
        self._finished(reqs)

    def _on_swap_model(self, msg: SwapModel) -> None:
        if self.policy is None:
            self.outbox(msg.reply_to).send(SwapResult(ticket=msg.ticket, ok=False, mode=msg.mode,
                                                      error="the worker is restarting"))
            return
        self.swaps.start(msg, self.policy)

    def _on_model_loaded(self, msg: ModelLoaded) -> None:
        if self.policy is None:
            return
        self.swaps.on_loaded(msg, self.policy, self._adopt)

    def _on_tokenized(self, msg: TokenizedRequest) -> None:
        if self.policy is None:
            self._reject(msg.request_id, 503, "the worker is restarting; retry shortly")
            return
        s = self.config.scheduler
        if self.policy.num_waiting >= s.max_waiting:
            self._reject(msg.request_id, 429, f"server overloaded: {self.policy.num_waiting} "
                         f"requests waiting (max_waiting={s.max_waiting}); retry later")
            return
        if len(msg.prompt_token_ids) >= self.max_model_len:
            self._reject(msg.request_id, 400, f"prompt has {len(msg.prompt_token_ids)} tokens; "
                         f"this server holds at most {self.max_model_len - 1}", "messages")
            return
        if msg.request_id in self.policy.requests or msg.request_id in self.groups:
            self._reject(msg.request_id, 400, f"request id {msg.request_id!r} is already in "
                         "flight", "X-Request-Id")
            return
        reqs = self._sequences(msg)
        for req in reqs:
            self.policy.add(req)
        self.detokenizer.send(DetokNew(
            request_ids=[r.request_id for r in reqs], stop=[list(msg.sampling.stop)] * len(reqs),
            num_prompt_tokens=[len(msg.prompt_token_ids)] * len(reqs),
            prompt_tails=[msg.prompt_token_ids[-_PROMPT_TAIL:]] * len(reqs)))

    def _sequences(self, msg: TokenizedRequest) -> list[Request]:
        """One Request, or for n > 1 a leader and n - 1 forks named `<id>#<i>`."""
        n = msg.sampling.n
        ids = [msg.request_id] if n == 1 else [f"{msg.request_id}#{i}" for i in range(n)]
        reqs: list[Request] = []
        for i, rid in enumerate(ids):
            sampling = msg.sampling
            if sampling.seed is not None and i:
                sampling = dataclasses.replace(sampling, seed=sampling.seed + i)
            reqs.append(Request(rid, msg.prompt_token_ids, sampling, msg.eos_token_ids,
                                max_model_len=self.max_model_len, arrival_time=msg.arrival_time,
                                cache_root=self.cache_root, priority=msg.priority,
                                timeout=msg.timeout, fork_of=reqs[0] if i else None))
        if n > 1:
            self.groups[msg.request_id] = ids
        return reqs

    def _on_abort(self, msg: Abort) -> None:
        if self.policy is None:
            return
        reason = FinishReason(msg.reason)
        ids = [sid for rid in msg.request_ids for sid in self.groups.get(rid, [rid])]
        self._finished(r for sid in ids if (r := self.policy.abort(sid, reason)))

    def _finished(self, reqs: Any) -> None:
        """Tell the detokenizer that these requests ended without a new token."""
        reqs = list(reqs)
        if reqs:
            self.detokenizer.send(TokenBatch(
                request_ids=[r.request_id for r in reqs], token_ids=[[] for _ in reqs],
                finish_reasons=[int(r.finish_reason) for r in reqs]))
            self._forget_groups(reqs)

    def _forget_groups(self, reqs: list[Request]) -> None:
        for r in reqs:
            rid, sep, _ = r.request_id.rpartition("#")
            if sep and rid in self.groups and not any(
                    sid in self.policy.requests for sid in self.groups[rid]):  # type: ignore[union-attr]
                del self.groups[rid]

    def _on_step_result(self, msg: StepResult) -> None:
        if self.policy is None:
            return  # from a worker that has since died
        if not self.in_flight or msg.step_id != self.in_flight[0].step_id:
            log.warning("unexpected step result %d", msg.step_id)
            return
        step = self.in_flight.popleft()
        if msg.error:
            log.error("step %d failed on the worker: %s", msg.step_id, msg.error)
            reqs = [r for rid in step.req_ids if (r := self.policy.requests.get(rid))]
            self._fail(reqs, 500, f"the model step failed ({msg.error})")
            return
        self.num_steps += 1
        now = time.perf_counter()
        self.step_time_s += now - step.sent_at
        self.worker_time_s += msg.forward_s
        if self._busy_since_last_result and self._last_result_at:
            # back-to-back steps: the gap beyond the worker's own time is scheduling cost
            self.interval_s += now - self._last_result_at
            self.interval_forward_s += msg.forward_s
            self.num_intervals += 1
        self._last_result_at = now
        results = self.policy.update(msg.req_ids, msg.token_ids, msg.num_tokens,
                                     msg.num_proposed)
        if results:
            self.detokenizer.send(TokenBatch(
                request_ids=[r.request_id for r, _, _ in results],
                token_ids=[tokens for _, tokens, _ in results],
                finish_reasons=[int(f) for _, _, f in results],
                num_cached_tokens=[r.num_cached_tokens for r, _, _ in results],
                versions=[r.version or "" for r, _, _ in results]))
            self._forget_groups([r for r, _, f in results if f != FinishReason.NONE])

    def _on_stats_query(self, msg: StatsQuery) -> None:
        data = self.request_rows() if msg.what == "requests" else self.stats()
        self.outbox(msg.reply_to).send(Stats(name=self.name, query_id=msg.query_id, data=data))

    def request_rows(self) -> dict[str, Any]:
        """GET /admin/requests: id, state, tokens so far, age of every live request."""
        if self.policy is None:
            return {"requests": []}
        now = time.time()
        rows = [{
            "id": r.request_id,
            "state": _state_name(r),
            "num_prompt_tokens": r.num_prompt_tokens,
            "num_output_tokens": len(r.output_token_ids),
            "num_computed_tokens": r.num_computed_tokens,
            "num_cached_tokens": r.num_cached_tokens,
            "num_blocks": len(self.policy.blocks.block_tables.get(r.request_id, ())),
            "priority": r.priority,
            "age_s": round(now - r.arrival_time, 3),
            "arrival_time": r.arrival_time,
            "version": r.version or "",
        } for r in sorted(self.policy.requests.values(), key=lambda r: r.arrival_seq)]
        return {"requests": rows}

    # the step -----------------------------------------------------------------------------
    async def on_idle(self) -> None:
        policy = self.policy
        if policy is None:
            return
        while len(self.in_flight) < self.max_in_flight and policy.has_work():
            out = policy.schedule()
            if out.is_empty:
                break
            self.step_counter += 1
            step = _InFlight(self.step_counter, [s.request.request_id for s in out.scheduled],
                             time.perf_counter())
            self.in_flight.append(step)
            self.worker.send(to_plan(step.step_id, out))
        self._busy_since_last_result = bool(self.in_flight)
        self.swaps.advance(policy, in_flight=bool(self.in_flight))
        if not self.in_flight and not policy.has_work() and not policy.requests:
            # whenever idle, every block is free (O(1)); block by block now and then (a
            # pool of 65k blocks takes ~7 ms to walk: not in the way of every request)
            policy.check_idle()
            now = time.monotonic()
            if self.num_steps != self._checked_at_step and now - self._checked_at > 5.0:
                policy.check_integrity()
                self._checked_at, self._checked_at_step = now, self.num_steps

    async def _tick(self) -> None:
        """Deadlines (timeouts) and batch windows need time, not messages, to pass."""
        while True:
            await asyncio.sleep(_TICK_S)
            if self.policy is None:
                continue
            self._finished(self.policy.expire())
            if self.policy.has_work():
                await self.on_idle()

    def _reject(self, request_id: str, status: int, message: str, param: str | None = None) -> None:
        log.info("rejected: %s", message, extra={"request_id": request_id})
        self.gateway.send(RequestError(request_id=request_id, status=status, message=message,
                                       param=param))

    def stats(self) -> dict[str, Any]:
        p = self.policy
        if p is None:
            return {"ready": False}
        b = p.blocks
        return {
            "ready": True,
            "num_waiting": p.num_waiting,
            "num_running": p.num_running,
            "num_swapped": sum(1 for r in p.waiting if r.is_swapped),
            "num_total_blocks": b.num_blocks,
            "num_free_blocks": b.num_free_blocks,
            "num_cached_blocks": b.num_cached_blocks,
            "num_used_blocks": b.num_used_blocks,
            "kv_cache_usage": b.usage,
            "prefix_cache_queries": b.num_cached_queries,
            "prefix_cache_hits": b.num_cached_hits,
            "num_preemptions": p.num_preemptions,
            "num_swaps": p.num_swaps,
            "num_steps": self.num_steps,
            "num_computed_tokens": p.num_computed_tokens_total,
            "mean_step_s": self.step_time_s / max(1, self.num_steps),
            "mean_worker_s": self.worker_time_s / max(1, self.num_steps),
            "num_steps_in_flight": len(self.in_flight),
            "version": p.version,
            "swap": self.swaps.status(),
            "num_model_swaps": self.swaps.num_swaps,
            "mean_step_interval_s": self.interval_s / max(1, self.num_intervals),
            "mean_step_forward_s": self.interval_forward_s / max(1, self.num_intervals),
            "spec_num_drafts": p.num_spec_rounds,
            "spec_num_draft_tokens": p.num_draft_tokens,
            "spec_num_accepted_tokens": p.num_accepted_tokens,
            "spec_acceptance_rate": p.num_accepted_tokens / max(1, p.num_draft_tokens),
            # tokens per verification round: the accepted drafts plus the token every step
            # yields (vLLM's "mean acceptance length")
            "spec_mean_accepted_length": 1 + p.num_accepted_tokens / max(1, p.num_spec_rounds),
            "request_ids": sorted(p.requests),
            "model": self.worker_info,
        }


def _state_name(r: Request) -> str:
    """waiting | prefill | decoding | preempted | swapped"""
    if r.is_swapped:
        return "swapped"
    if r.status == Status.WAITING:
        return "preempted" if r.num_preemptions else "waiting"
    return "prefill" if r.num_computed_tokens < r.num_prompt_tokens else "decoding"
