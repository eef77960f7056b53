"""The router process (data parallelism): tokenisers push every tokenised request here; it
picks a replica (services/router/policy.py) and forwards the request to that replica's
scheduler.

Why a process of its own rather than a choice in each tokenizer: one router sees every
decision it makes at once, so a burst is spread by the load it has just added (N tokenizers
deciding apart would each see the same stale load), the replicas' notices go to one place
instead of N, and tokenizers stay stateless. It costs one more local hop per request.

    tokenizer ─TokenizedRequest─▶ router ─▶ scheduler-<i>
                                    ▲  └─(no replica ready) RequestError 503 ─▶ gateway
    scheduler-<i> ─ReplicaNotice────┘
    supervisor ─ProcessDown(scheduler-<i>)─▶ router: its live requests fail (503, retry)

At start-up (and after a restart of the router itself) requests wait here instead of
failing until every replica has told what it holds, or, when one is ready but another stays
silent (down), for at most `_HEAR_ALL_S` after the first ready one: routed earlier, a
request would go to whichever replica spoke first, missing the prefix cached on another.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from typing import Any

from common.actor import Actor
from common.config import Config
from common.messages import (
    KvHandover,
    ProcessDown,
    ReplicaNotice,
    RequestError,
    Stats,
    StatsQuery,
    TokenizedRequest,
)
from common.topology import replica_addrs, replica_name, replica_roles, router_addr
from services.router.policy import ReplicaView, Router

log = logging.getLogger(__name__)

_HEAR_ALL_S = 1.0


class RouterActor(Actor):
    name = "router"

    def __init__(self, config: Config) -> None:
        super().__init__(config, inbox_addr=router_addr(config))
        dp = config.data_parallel
        self.router = Router(
            dp.data_parallel_size, dp.dp_routing, dp.dp_load_bound, replica_roles(config)
        )
        # prefill/decode replicas: the shm folders of hand-overs a decode replica holds,
        # removed when it reports the request ended or dies (it may die before its import)
        self.transfers: dict[str, list[str]] = {}
        self.names = [
            replica_name("scheduler", i, dp.data_parallel_size)
            for i in range(dp.data_parallel_size)
        ]
        self.parked: list[TokenizedRequest] = []  # until the replicas have been heard
        self.heard: set[int] = set()  # replicas that have sent a notice
        self.was_ever_ready = False
        self.handlers.update(
            {
                TokenizedRequest: self._on_request,
                ReplicaNotice: self._on_notice,
                ProcessDown: self._on_process_down,
                StatsQuery: self._on_stats_query,
                KvHandover: self._on_handover,
            }
        )

    async def start(self) -> None:
        self.replica_boxes = [self.outbox(a) for a in replica_addrs(self.config, "scheduler")]
        self.gateway = self.gateways()

    def ready_info(self) -> dict[str, Any]:
        return {"num_replicas": len(self.replica_boxes), "routing": self.router.routing}

    def _on_request(self, req: TokenizedRequest) -> None:
        if not self.was_ever_ready:
            self.parked.append(req)
            return
        decision = self.router.route(
            req.request_id, req.prompt_token_ids, req.tokenizer_fingerprint, req.lora_name
        )
        if decision is None:
            self._fail(req.request_id, "no engine replica is ready (restarting)")
            return
        self.replica_boxes[decision.replica].send(req)

    def _on_handover(self, msg: KvHandover) -> None:
        """A prefill replica hands a sequence over: to the least loaded decode replica."""
        chosen = self.router.route_handover(
            msg.request_id, msg.tokenizer_fingerprint, (msg.lora_name, msg.lora_hash)
        )
        if chosen is None:
            if msg.transfer_dir:
                shutil.rmtree(msg.transfer_dir, ignore_errors=True)
            self._fail(msg.request_id, "no decode replica is ready (restarting)")
            return
        if msg.transfer_dir:
            self.transfers.setdefault(msg.request_id, []).append(msg.transfer_dir)
        self.replica_boxes[chosen.index].send(msg)

    def _forget_transfers(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            for folder in self.transfers.pop(request_id, []):
                shutil.rmtree(folder, ignore_errors=True)

    def _on_notice(self, msg: ReplicaNotice) -> None:
        self.router.on_notice(msg)
        if self.router.replicas[msg.replica].role == "decode":
            self._forget_transfers(msg.ended_request_ids)
        if self.was_ever_ready:
            return
        first_ready = msg.is_ready and not any(r.is_ready for r in self._others(msg.replica))
        self.heard.add(msg.replica)
        if len(self.heard) == len(self.replica_boxes) and any(
            r.is_ready for r in self.router.replicas
        ):
            self._release()
        elif first_ready:
            asyncio.get_running_loop().call_later(_HEAR_ALL_S, self._release)

    def _others(self, index: int) -> list[ReplicaView]:
        return [r for r in self.router.replicas if r.index != index]

    def _release(self) -> None:
        """Route the requests that waited for the replicas to be heard."""
        if self.was_ever_ready:
            return
        self.was_ever_ready = True
        parked, self.parked = self.parked, []
        for req in parked:
            self._on_request(req)

    def _on_process_down(self, msg: ProcessDown) -> None:
        if msg.name not in self.names:
            return  # a worker's death reaches us as its scheduler's notice
        index = self.names.index(msg.name)
        lost = self.router.on_replica_down(index)
        self._forget_transfers(lost)
        log.error("%s died: routing around it; %d requests fail", msg.name, len(lost))
        for request_id in lost:
            self._fail(request_id, f"the {msg.name} process restarted")

    def _fail(self, request_id: str, why: str) -> None:
        self.gateway.send(
            RequestError(
                request_id=request_id,
                status=503,
                message=f"{why}; the request was not completed, retry it",
            )
        )

    def _on_stats_query(self, msg: StatsQuery) -> None:
        data = self.router.stats()
        self.outbox(msg.reply_to).send(Stats(name=self.name, query_id=msg.query_id, data=data))
