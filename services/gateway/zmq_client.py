"""The real EngineClient: requests go out over ZeroMQ, deltas come back into per-request queues.

A request with n > 1 comes back as n sequences named `<id>#<i>` (the scheduler forks them);
their deltas go into the queue of `<id>` tagged with index i, and the request ends when the
last of them finishes. Client-chosen ids never hold '#', so the name cannot be ambiguous.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from common.ipc import Outbox
from common.messages import (
    Abort,
    FinishReason,
    GenerateRequest,
    OutputBatch,
    RequestError,
    Stats,
    StatsQuery,
    SwapModel,
    SwapResult,
)
from services.gateway.engine_client import OutputDelta, RequestFailed

log = logging.getLogger(__name__)


def split_sequence_id(sequence_id: str) -> tuple[str, int]:
    """Split "req#2" into ("req", 2); a plain request id is its own sequence 0."""
    request_id, sep, index = sequence_id.rpartition("#")
    if sep and index.isdigit():
        return request_id, int(index)
    return sequence_id, 0


class _Stream:
    """One in-flight request: its queue, and which of its sequences are still running."""

    def __init__(self, n: int) -> None:
        self.queue: asyncio.Queue[OutputDelta | RequestFailed] = asyncio.Queue()
        self.running = set(range(n))
        self.has_output = False

    def put(self, msg: OutputBatch, i: int, index: int) -> None:
        finish = FinishReason(msg.finish_reasons[i])
        self.has_output = True
        if finish != FinishReason.NONE:
            self.running.discard(index)
        self.queue.put_nowait(
            OutputDelta(
                text=msg.texts[i],
                token_ids=msg.token_ids[i],
                finish_reason=finish,
                num_prompt_tokens=msg.num_prompt_tokens[i],
                num_output_tokens=msg.num_output_tokens[i],
                last=not self.running,
                index=index,
                version=msg.versions[i] if msg.versions else "",
            )
        )


class ZmqEngineClient:
    """Keeps one queue per in-flight request; the gateway actor feeds them from its inbox."""

    def __init__(self, tokenizers: Outbox, scheduler: Outbox, inbox_addr: str) -> None:
        self.tokenizers = tokenizers
        self.scheduler = scheduler
        self.inbox_addr = inbox_addr
        self.model_info: dict[str, Any] = {}
        self.model_name = ""
        self.system_fingerprint = ""
        self.max_model_len = 0
        self._streams: dict[str, _Stream] = {}
        self._stats_waiters: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._swap_waiters: dict[int, asyncio.Future[SwapResult]] = {}
        self.swap_status: dict[str, Any] | None = None  # a swap in progress, from the stats
        self.draining = False  # shutting down: new requests get 503
        self._query_ids = itertools.count()
        # request timings (services/gateway/metrics.py): called with each request on arrival
        self.observer: Callable[[GenerateRequest], Any] | None = None

    def is_ready(self) -> bool:
        return bool(self.model_info) and not self.draining

    def fail_all(self, why: str, only_waiting: bool = False) -> int:
        """A process behind us died: end requests in flight with a retryable 503 (those with
        no output yet when `only_waiting`). Returns how many."""
        failed = 0
        for stream in self._streams.values():
            if not (only_waiting and stream.has_output):
                stream.queue.put_nowait(RequestFailed(503, f"{why}; retry the request"))
                failed += 1
        return failed

    def set_model_info(self, info: dict[str, Any]) -> None:
        self.model_info = info
        self.model_name = info["model_name"]
        self.system_fingerprint = info.get("weights_version", "")
        self.max_model_len = info["max_model_len"]

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[OutputDelta]:
        rid = request.request_id
        if rid in self._streams:
            raise RequestFailed(
                400, f"X-Request-Id: request id {rid!r} is already in flight", "X-Request-Id"
            )
        stream = _Stream(request.sampling.n)
        self._streams[rid] = stream
        finished = False
        timer = self.observer(request) if self.observer is not None else None
        try:
            self.tokenizers.send(request)
            while True:
                item = await stream.queue.get()
                if isinstance(item, RequestFailed):
                    finished = True
                    if timer is not None:
                        timer.failed(item.status)
                    raise item
                finished = item.last
                if timer is not None:
                    timer.delta(item)
                yield item
                if finished:
                    return
        finally:
            if not finished:  # the client went away or the caller stopped reading
                # one Abort for the request id: the scheduler aborts all its sequences
                self.scheduler.send(Abort(request_ids=[rid], reason=int(FinishReason.CANCELLED)))
            # state goes only after the abort is sent (DESIGN §8)
            self._streams.pop(rid, None)
            if timer is not None:
                timer.end()

    def is_in_flight(self, request_id: str) -> bool:
        return request_id in self._streams

    async def swap_model(self, path: str, version: str, mode: str,
                         timeout: float = 600.0) -> SwapResult:
        """Ask the scheduler to swap the served model; wait for the outcome."""
        ticket = next(self._query_ids)
        fut: asyncio.Future[SwapResult] = asyncio.get_running_loop().create_future()
        self._swap_waiters[ticket] = fut
        try:
            self.scheduler.send(SwapModel(ticket=ticket, reply_to=self.inbox_addr, path=path,
                                          version=version, mode=mode))
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._swap_waiters.pop(ticket, None)

    def on_swap_result(self, msg: SwapResult) -> None:
        fut = self._swap_waiters.get(msg.ticket)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    async def abort(self, request_id: str) -> None:
        self.scheduler.send(Abort(request_ids=[request_id], reason=int(FinishReason.CANCELLED)))

    async def stats(self, timeout: float = 5.0, what: str = "stats") -> dict[str, Any]:
        """The scheduler's counters (`what="requests"`: its live requests, one row each)."""
        qid = next(self._query_ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._stats_waiters[qid] = fut
        try:
            self.scheduler.send(StatsQuery(reply_to=self.inbox_addr, query_id=qid, what=what))
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._stats_waiters.pop(qid, None)

    # fed by the gateway actor ---------------------------------------------------------------
    def on_outputs(self, msg: OutputBatch) -> None:
        for i, sequence_id in enumerate(msg.request_ids):
            rid, index = split_sequence_id(sequence_id)
            stream = self._streams.get(rid)
            if stream is not None:  # else: finished or aborted, its late outputs are moot
                stream.put(msg, i, index)

    def on_error(self, msg: RequestError) -> None:
        # an error about one sequence fails the whole request
        stream = self._streams.get(split_sequence_id(msg.request_id)[0])
        if stream is not None:
            stream.queue.put_nowait(RequestFailed(msg.status, msg.message, msg.param))

    def on_stats(self, msg: Stats) -> None:
        fut = self._stats_waiters.get(msg.query_id)
        if fut is not None and not fut.done():
            fut.set_result(msg.data)
