"""The gateway's stats queries: a StatsQuery to the scheduler (every replica's, and the
router's with several) and the answers merged (services/gateway/engine/replicas.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

from common.ipc import Sender
from common.messages import Stats, StatsQuery
from services.gateway.engine.replicas import PendingQueries, merge_request_rows, merge_stats


class StatsQueries:
    """Asks for counters or live requests and waits for the answers (fed by `on_stats`)."""

    def __init__(
        self,
        scheduler: Sender,
        inbox_addr: str,
        num_replicas: int,
        router: Sender | None,
        tickets: Iterator[int],
    ) -> None:
        self.scheduler = scheduler  # every replica's (a fan-out with several)
        self.inbox_addr = inbox_addr
        self.num_replicas = num_replicas
        self.router = router
        self._tickets = tickets
        self._pending = PendingQueries()

    async def ask(self, timeout: float = 5.0, what: str = "stats") -> dict[str, Any]:
        """The scheduler's counters (`what="requests"`: its live requests, one row each).
        With several replicas, theirs merged (services/gateway/engine/replicas.py), a replica that
        does not answer within `timeout` (restarting) as not ready, and the router's
        counters under `router`."""
        if self.num_replicas == 1:
            answers = await self._ask(self.scheduler, 1, what, timeout)
            if not answers:
                raise TimeoutError("the scheduler did not answer")
            return next(iter(answers.values()))
        asks = [self._ask(self.scheduler, self.num_replicas, what, timeout)]
        if self.router is not None and what == "stats":
            asks.append(self._ask(self.router, 1, what, timeout))
        replicas, *routing = await asyncio.gather(*asks)
        if not replicas:
            raise TimeoutError("no replica answered")
        if what == "requests":
            return merge_request_rows(replicas)
        merged = merge_stats(replicas, self.num_replicas)
        if routing and "router" in routing[0]:
            merged["router"] = routing[0]["router"]
        return merged

    async def _ask(
        self, to: Sender, expected: int, what: str, timeout: float
    ) -> dict[str, dict[str, Any]]:
        """A StatsQuery to `to` (a fan-out: `expected` answers): the answers by who gave
        them, those that came within `timeout`."""
        qid = next(self._tickets)
        query = StatsQuery(reply_to=self.inbox_addr, query_id=qid, what=what)
        return await self._pending.ask(qid, expected, lambda: to.send(query), timeout)

    def on_stats(self, msg: Stats) -> None:
        self._pending.answer(msg.query_id, msg.name, msg.data)
