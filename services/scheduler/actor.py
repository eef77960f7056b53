"""The scheduler process: wires its sockets to an EngineCore (services/scheduler/engine_core.py),
which owns the queues, the KV block accounting, the steps in flight and the served model.

Up to two steps are in flight with `--async-scheduling` (one without): step N+1 is planned
and sent while the worker computes step N; its decode inputs are the tokens step N samples,
resolved on the worker. Messages that arrive meanwhile (new requests, aborts) are applied
before the next plan. A stop seen one step late costs one discarded token, nothing more.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from common.actor import Actor
from common.config import Config
from common.messages import (
    Abort,
    FinishReason,
    GrammarCompiled,
    KvExported,
    KvHandover,
    LoadLoraAdapter,
    LoraAdapterResult,
    LoraLoaded,
    ModelChanged,
    ModelLoaded,
    ProcessDown,
    Ready,
    Reset,
    Stats,
    StatsQuery,
    StepResult,
    SwapModel,
    SwapResult,
    TokenizedRequest,
    UnloadLoraAdapter,
)
from common.topology import gateway_index, num_gateways, own_name, router_addr
from services.scheduler.engine_core import EngineCore
from services.scheduler.engine_view import request_rows, stats
from services.scheduler.outbox import ToDetokenizer, ToGateway, ToWorker
from services.scheduler.replica_notices import NoticeBuilder

log = logging.getLogger(__name__)

_TICK_S = 0.05  # how often deadlines and batch windows are looked at


class _Sockets:
    """EngineCore's outbox over this process's sockets."""

    def __init__(self, actor: SchedulerActor) -> None:
        self.actor = actor
        config = actor.config
        self.worker = actor.outbox(config.addr("worker"))
        self.detokenizer = actor.outbox(config.addr("detokenizer"))
        self.gateway = actor.gateways()
        # one socket per tokenizer: a PUSH over several addresses would pick one of them
        self.tokenizers = [actor.outbox(a) for a in config.tokenizer_addrs()]

    def to_worker(self, msg: ToWorker) -> None:
        self.worker.send(msg)

    def to_detokenizer(self, msg: ToDetokenizer) -> None:
        self.detokenizer.send(msg)

    def to_gateway(self, msg: ToGateway) -> None:
        self.gateway.send(msg)

    def announce(self, msg: ModelChanged) -> None:
        self.gateway.send(msg)  # (every gateway process)
        for box in (self.detokenizer, *self.tokenizers):
            box.send(msg)

    def reply(self, address: str, msg: SwapResult | LoraAdapterResult) -> None:
        self.actor.outbox(address).send(msg)


class SchedulerActor(Actor):
    name = "scheduler"

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        # a prefill replica sends the sequences it hands over to the router
        to_router = (
            self.outbox(router_addr(config)).send
            if config.data_parallel.own_role == "prefill"
            else None
        )
        self.core = EngineCore(config, _Sockets(self), to_router=to_router)
        self.worker_name = own_name(config, "worker")
        # data parallelism: tell the router what this replica caches and holds
        dp = config.data_parallel
        self.notices = NoticeBuilder(dp.replica_index) if dp.data_parallel_size > 1 else None
        self.handlers.update(
            {
                TokenizedRequest: self._on_tokenized,
                StepResult: self.core.on_step_result,
                KvExported: self.core.on_kv_exported,
                GrammarCompiled: self.core.on_grammar_compiled,
                Abort: self._on_abort,
                StatsQuery: self._on_stats_query,
                Ready: self._on_ready,
                SwapModel: self.core.swap,
                ModelLoaded: self.core.on_model_loaded,
                ProcessDown: self._on_process_down,
                LoadLoraAdapter: self.core.load_lora,
                UnloadLoraAdapter: self.core.unload_lora,
                LoraLoaded: self.core.on_lora_loaded,
                KvHandover: self._on_handover,
            }
        )
        self.ticker: asyncio.Task[None] | None = None

    async def start(self) -> None:
        # a restarted scheduler finds the worker running: ask it to start over and re-announce
        self.outbox(self.config.addr("worker")).send(Reset(reason="scheduler started"))
        assert self.inbox is not None
        # the worker's Ready sizes the block pool; the start-up adapters load after it
        while not (self.core.is_ready and self.core.loras.is_settled):
            await self.dispatch(await self.inbox.recv())
        self.ticker = asyncio.create_task(self._tick())
        self._notify()

    async def stop(self) -> None:
        if self.ticker is not None:
            self.ticker.cancel()

    @property
    def inbox_name(self) -> str:
        return own_name(self.config, "scheduler")

    def ready_info(self) -> dict[str, Any]:
        return dataclasses.asdict(self.core.served.info) if self.core.served else {}

    def _on_ready(self, msg: Ready) -> None:
        # (a worker's answer to our Reset names it `worker`)
        if msg.name in ("worker", self.worker_name) and msg.model is not None:
            self.core.on_worker_ready(msg.model)

    def _on_tokenized(self, msg: TokenizedRequest) -> None:
        if self.notices is not None:
            self.notices.received(msg.request_id)
        self.core.add(msg)

    def _on_handover(self, msg: KvHandover) -> None:
        if self.notices is not None:
            self.notices.received(msg.request_id)
        self.core.on_handover(msg)

    def _notify(self) -> None:
        """Data parallelism: the router hears what changed (cached blocks, ended requests)."""
        if self.notices is not None and (notice := self.notices.build(self.core)) is not None:
            self.outbox(router_addr(self.config)).send(notice)

    def _on_process_down(self, msg: ProcessDown) -> None:
        """A peer died: its requests cannot finish. Fail them all with a retryable error and
        free their blocks; a new worker announces itself with Ready (a new pool). Any other
        process starts again from the start-up model: tell it which model is served (the
        message waits in our socket until it is up)."""
        if msg.name == "router":  # a new router: tell it everything again
            if self.notices is not None:
                self.notices.resync()
            return
        gateway = gateway_index(msg.name)
        if gateway is not None:  # one of several gateways: only its requests lost their client
            n = self.core.abort_owned_by(gateway, num_gateways(self.config))
            log.warning("%s died: %d of its requests cancelled", msg.name, n)
        if msg.name == self.worker_name:  # this replica's worker (`worker-<i>` with several)
            msg = ProcessDown(name="worker", exit_code=msg.exit_code)
        if msg.name in ("worker", "detokenizer", "gateway"):
            log.error("%s died (exit %d): failing the requests in flight", msg.name, msg.exit_code)
            why = f"the {msg.name} process restarted"
            if msg.name == "worker":  # not ready until the new worker's Ready
                self.core.on_worker_down(why)
                return
            # a new detokenizer decodes a resumed request from its outputs so far
            self.core.fail_all(why, resumable=msg.name == "detokenizer")
        self.core.announce()
        if self.core.loras.enabled:  # (and which adapters it serves)
            self.core.loras.changed()

    def _on_abort(self, msg: Abort) -> None:
        self.core.abort(msg.request_ids, FinishReason(msg.reason), msg.seq_indices)

    def _on_stats_query(self, msg: StatsQuery) -> None:
        data = request_rows(self.core) if msg.what == "requests" else stats(self.core)
        self.outbox(msg.reply_to).send(
            Stats(name=self.inbox_name, query_id=msg.query_id, data=data)
        )

    async def on_idle(self) -> None:
        self.core.step()
        self._notify()

    async def _tick(self) -> None:
        """Deadlines (timeouts) and batch windows need time, not messages, to pass."""
        while True:
            await asyncio.sleep(_TICK_S)
            self.core.expire()
            if self.core.has_work:
                self.core.step()
            self._notify()
