"""The real EngineClient: requests go out over ZeroMQ, deltas come back into per-request queues.

A request with n > 1 comes back as n sequences (request id, index 0..n-1); their deltas go
into the request's queue tagged with the index, and the request ends when the last of them
finishes.

What the engine serves (model name, version, context length) is pushed by the scheduler
(`ModelChanged`): once the worker is ready, and after every swap or worker restart. A request
the scheduler cannot start because a swap changed the tokenizer after it was tokenised comes
back as `Retokenize`; the client still holds it and sends it to a tokenizer again.

A request lost to the death of a process behind the gateway is sent again where it stopped
(`Resumes`, services/gateway/engine/resume.py, over the stream tables kept here): outputs and
errors are looked up by the wire id of the stream's current attempt
(services/gateway/engine/stream.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

from common.ipc import Outbox, Sender
from common.messages import (
    Abort,
    DetokenizeQuery,
    FinishReason,
    GenerateRequest,
    LoraAdapterResult,
    ModelChanged,
    OutputBatch,
    RequestError,
    Retokenize,
    Stats,
    SwapModel,
    SwapResult,
    TokenizeQuery,
    TokenizeResult,
)
from common.wire_id import client_id
from services.gateway.engine.client import OutputDelta, RequestFailed, RequestObserver
from services.gateway.engine.lora_adapters import LoraAdapters
from services.gateway.engine.peers import GatewayPeers, no_peers
from services.gateway.engine.replicas import Replies, merge_swap_results
from services.gateway.engine.resume import Resumes
from services.gateway.engine.stats import StatsQueries
from services.gateway.engine.stream import ONE_GATEWAY, Stream, WireIds

log = logging.getLogger(__name__)

# A request is tokenised again at most this many times (each time a swap changed the
# tokenizer before it started); then it fails with a retryable 503.
MAX_RETOKENIZE = 4


class ZmqEngineClient:
    """Keeps one queue per in-flight request; the gateway actor feeds them from its inbox."""

    def __init__(
        self,
        tokenizers: Outbox,
        scheduler: Sender,
        inbox_addr: str,
        aliases: Sequence[str] = (),
        num_replicas: int = 1,
        router: Sender | None = None,
        enable_lora: bool = False,
        resume_timeout: float = 0.0,
        wire_ids: WireIds = ONE_GATEWAY,
        peers: GatewayPeers | None = None,
    ) -> None:
        self.tokenizers = tokenizers
        self.wire_ids = wire_ids  # which gateway process this is: its requests' wire ids
        self.aliases = list(aliases)  # --served-model-name: more names the model answers to
        self.scheduler = scheduler  # every replica's scheduler (a fan-out with several)
        self.num_replicas = num_replicas
        self.router = router  # data parallelism: asked for its routing counters
        self.inbox_addr = inbox_addr
        self.served: ModelChanged | None = None  # what the scheduler last said it serves
        self._is_serving = False  # False again while the worker or the scheduler restarts
        self._streams: dict[str, Stream] = {}  # by the client's request id
        self._by_wire: dict[str, Stream] = {}  # by the id its current attempt travels under
        # requests lost to a process's death, sent again (resume.py)
        self.resumes = Resumes(self._streams, self._by_wire, tokenizers, scheduler, resume_timeout)
        self._swap_waiters: dict[int, Replies[SwapResult]] = {}
        self._tokenize_waiters: dict[int, asyncio.Future[TokenizeResult]] = {}
        self.swap_status: dict[str, Any] | None = None  # the swap this gateway asked for
        self.draining = False  # shutting down: new requests get 503
        self._query_ids = itertools.count()
        self.peers = peers or no_peers()  # the other gateway processes (engine/peers.py)
        self._stats = StatsQueries(scheduler, inbox_addr, num_replicas, router, self._query_ids)
        # LoRA adapters (lora_adapters.py): what the schedulers serve, loads and unloads
        self.loras = LoraAdapters(
            enable_lora, scheduler, inbox_addr, num_replicas, tickets=self._query_ids
        )
        # request timings (services/gateway/http/metrics.py): called with each request on arrival
        self.observer: Callable[[GenerateRequest], RequestObserver] | None = None

    @property
    def model_name(self) -> str:
        return self.served.name if self.served is not None else ""

    @property
    def model_names(self) -> list[str]:
        if self.served is None:
            return []
        return [self.served.name, *(a for a in self.aliases if a != self.served.name)]

    @property
    def system_fingerprint(self) -> str:
        return self.served.version if self.served is not None else ""

    @property
    def lora_enabled(self) -> bool:
        return self.loras.enabled

    @property
    def lora_adapters(self) -> dict[str, str]:
        return self.loras.paths

    async def load_lora(self, name: str, path: str, timeout: float = 600.0) -> LoraAdapterResult:
        return await self.loras.load(name, path, timeout=timeout)

    async def unload_lora(self, name: str, timeout: float = 600.0) -> LoraAdapterResult:
        return await self.loras.unload(name, timeout=timeout)

    @property
    def max_model_len(self) -> int:
        return self.served.max_model_len if self.served is not None else 0

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self.served.eos_token_ids) if self.served is not None else []

    def is_ready(self) -> bool:
        """Serving: the scheduler has said which model (and nothing died since)."""
        return self._is_serving and not self.draining

    def fail_all(self, why: str, only_waiting: bool = False) -> int:
        """A process behind us died: end requests in flight with a retryable 503 (those with
        no output yet when `only_waiting`). Returns how many."""
        failed = 0
        for stream in self._streams.values():
            if not (only_waiting and stream.has_output):
                stream.queue.put_nowait(RequestFailed(503, f"{why}; retry the request"))
                failed += 1
        return failed

    def on_model_changed(self, msg: ModelChanged) -> None:
        """The scheduler serves this model now (pushed before a swap's SwapResult)."""
        if self.served is None or msg.version != self.served.version:
            log.info("serving %s version %s", msg.name, msg.version)
        self.served = msg
        self._is_serving = True
        self.resumes.resume_lost()

    def on_model_lost(self) -> None:
        """The worker or the scheduler died: not ready until the scheduler says again what
        it serves. /v1/models keeps naming the last model meanwhile."""
        self._is_serving = False

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[OutputDelta, None]:
        rid = request.request_id
        if rid in self._streams:
            raise RequestFailed(
                400, f"X-Request-Id: request id {rid!r} is already in flight", "X-Request-Id"
            )
        stream = Stream(request, self.wire_ids)
        self._streams[rid] = stream
        self._by_wire[stream.wire_id] = stream
        finished = False
        timer = self.observer(request) if self.observer is not None else None
        try:
            self.tokenizers.send(stream.sent)
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
                self.scheduler.send(
                    Abort(request_ids=[stream.wire_id], reason=int(FinishReason.CANCELLED))
                )
            # state goes only after the abort is sent (docs/architecture.md, "How a request flows")
            self._streams.pop(rid, None)
            self._by_wire.pop(stream.wire_id, None)
            if timer is not None:
                timer.end()

    def is_in_flight(self, request_id: str) -> bool:
        return request_id in self._streams

    async def swap_model(
        self, path: str, version: str, mode: str, timeout: float = 600.0
    ) -> SwapResult:
        """Ask the scheduler (every replica's) to swap the served model; wait for the
        outcome (every replica's)."""
        ticket = next(self._query_ids)
        replies: Replies[SwapResult] = Replies(self.num_replicas)
        self._swap_waiters[ticket] = replies
        status = {
            "mode": mode,
            "path": path,
            "from": self.system_fingerprint,
            "to": version or "(hash of the weights)",
        }
        self.swap_status = status
        try:
            self.scheduler.send(
                SwapModel(
                    ticket=ticket, reply_to=self.inbox_addr, path=path, version=version, mode=mode
                )
            )
            await asyncio.wait_for(replies.done.wait(), timeout)
            return merge_swap_results(list(replies.items.values()), self.num_replicas)
        finally:
            self._swap_waiters.pop(ticket, None)
            if self.swap_status is status:
                self.swap_status = None

    def on_swap_result(self, msg: SwapResult) -> None:
        replies = self._swap_waiters.get(msg.ticket)
        if replies is not None:
            replies.add(str(len(replies.items)), msg)

    async def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None and stream.is_lost:  # nothing runs it: it ends here
            stream.lost_at = None
            stream.queue.put_nowait(stream.cancelled())
            return
        wire_id = stream.wire_id if stream is not None else request_id
        self.scheduler.send(Abort(request_ids=[wire_id], reason=int(FinishReason.CANCELLED)))

    async def cancel(self, request_id: str, timeout: float = 2.0) -> bool:
        """End the request here if this process holds it, else wherever a peer does."""
        if request_id in self._streams or not self.peers.num_peers:
            held = request_id in self._streams
            await self.abort(request_id)
            return held
        return await self.peers.cancel(request_id, timeout)

    async def peer_requests(self, timeout: float = 1.0) -> list[dict[str, Any]]:
        return await self.peers.requests(timeout)

    async def stats(self, timeout: float = 5.0, what: str = "stats") -> dict[str, Any]:
        """The scheduler's counters, or its live requests (services/gateway/engine/stats.py),
        with each request by its client's id (the scheduler knows wire ids)."""
        answer = await self._stats.ask(timeout, what)
        n = self.wire_ids.num_gateways
        if n == 1:
            return answer
        if "request_ids" in answer:
            answer["request_ids"] = sorted(client_id(r, n) for r in answer["request_ids"])
        for row in answer.get("requests", ()):
            row["id"] = client_id(row["id"], n)
        return answer

    async def tokenize(
        self,
        prompt: str | None = None,
        messages: list[dict[str, Any]] | None = None,
        *,
        add_special_tokens: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        timeout: float = 10.0,
    ) -> list[int]:
        """A tokenizer's token ids of the prompt or messages (POST /tokenize)."""
        query = TokenizeQuery(
            query_id=next(self._query_ids),
            reply_to=self.inbox_addr,
            prompt=prompt,
            messages=messages,
            add_special_tokens=add_special_tokens,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
            tools=tools,
        )
        return (await self._ask_tokenizer(query, timeout)).token_ids

    async def detokenize(self, token_ids: list[int], timeout: float = 10.0) -> str:
        """A tokenizer's text of the token ids (POST /detokenize)."""
        query = DetokenizeQuery(
            query_id=next(self._query_ids), reply_to=self.inbox_addr, token_ids=token_ids
        )
        return (await self._ask_tokenizer(query, timeout)).text

    async def _ask_tokenizer(
        self, query: TokenizeQuery | DetokenizeQuery, timeout: float
    ) -> TokenizeResult:
        """Send the query to a tokenizer (round robin); its answer, or RequestFailed."""
        fut: asyncio.Future[TokenizeResult] = asyncio.get_running_loop().create_future()
        self._tokenize_waiters[query.query_id] = fut
        try:
            self.tokenizers.send(query)
            result = await asyncio.wait_for(fut, timeout)
        finally:
            self._tokenize_waiters.pop(query.query_id, None)
        if result.status != 200:
            raise RequestFailed(result.status, result.message, result.param)
        return result

    # fed by the gateway actor ---------------------------------------------------------------
    def on_outputs(self, msg: OutputBatch) -> None:
        indices = msg.seq_indices or [0] * len(msg.request_ids)
        for i, (rid, index) in enumerate(zip(msg.request_ids, indices, strict=True)):
            stream = self._by_wire.get(rid)
            if stream is not None:  # else: finished or aborted, its late outputs are moot
                stream.put(msg, i, index)

    def on_error(self, msg: RequestError) -> None:
        stream = self._by_wire.get(msg.request_id)
        if stream is None:
            return
        if msg.resumable and self.resumes.can_resume(stream):
            self.resumes.lose(stream, "its engine process died")  # resumed once it serves
            return
        stream.queue.put_nowait(RequestFailed(msg.status, msg.message, msg.param))

    def on_retokenize(self, msg: Retokenize) -> None:
        """A swap changed the tokenizer before the request started: the scheduler dropped
        it; send it to a tokenizer again (which now has the new tokenizer)."""
        stream = self._by_wire.get(msg.request_id)
        if stream is None:
            return  # the client went away meanwhile
        if stream.num_retokenized >= MAX_RETOKENIZE:
            stream.queue.put_nowait(
                RequestFailed(
                    503,
                    f"the served model changed {stream.num_retokenized + 1} times before the "
                    "request could start; retry the request",
                )
            )
            return
        stream.num_retokenized += 1
        log.info(
            "tokenising again (%d)", stream.num_retokenized, extra={"request_id": msg.request_id}
        )
        self.tokenizers.send(stream.sent)

    def on_tokenize_result(self, msg: TokenizeResult) -> None:
        fut = self._tokenize_waiters.get(msg.query_id)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    def on_stats(self, msg: Stats) -> None:
        self._stats.on_stats(msg)
