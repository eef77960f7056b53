"""The other gateway processes, as one gateway asks them (with --gateway-processes N > 1).

A request is held by the gateway process whose connection it came in on. What an operator
asks of the server as a whole goes to every other process too, over their inboxes:

    cancel by the client's id  ──GatewayQuery("cancel")──▶ each peer ends it if it holds it
    the console's live list    ──GatewayQuery("requests")─▶ each peer's rows

A peer that does not answer within the timeout (dead, restarting) counts as holding
nothing: its requests died with it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from common.ipc import Sender
from common.messages import GatewayAnswer, GatewayQuery
from services.gateway.engine.replicas import PendingQueries


class GatewayPeers:
    """Asks the `num_peers` other gateway processes (`peers`: a fan-out to them all)."""

    def __init__(
        self, peers: Sender, num_peers: int, inbox_addr: str, tickets: Iterator[int]
    ) -> None:
        self.peers = peers
        self.num_peers = num_peers
        self.inbox_addr = inbox_addr
        self._tickets = tickets
        self._pending = PendingQueries()

    async def cancel(self, request_id: str, timeout: float) -> bool:
        """End the request wherever a peer holds it: whether one did."""
        answers = await self.ask("cancel", timeout, request_id)
        return any(a.get("cancelled") for a in answers.values())

    async def requests(self, timeout: float) -> list[dict[str, Any]]:
        """Every peer's live requests, each row with the name of the process holding it."""
        answers = await self.ask("requests", timeout)
        return [
            {**row, "gateway": name}
            for name, data in sorted(answers.items())
            for row in data.get("requests", ())
        ]

    async def ask(
        self, what: str, timeout: float, request_id: str = ""
    ) -> dict[str, dict[str, Any]]:
        """The answers by peer name, those that came within `timeout`."""
        if self.num_peers == 0:
            return {}
        qid = next(self._tickets)
        query = GatewayQuery(
            reply_to=self.inbox_addr, query_id=qid, what=what, request_id=request_id
        )
        return await self._pending.ask(qid, self.num_peers, lambda: self.peers.send(query), timeout)

    def on_answer(self, msg: GatewayAnswer) -> None:
        self._pending.answer(msg.query_id, msg.name, msg.data)


def no_peers() -> GatewayPeers:
    """One gateway process: nobody to ask."""

    class _Nobody:
        def send(self, msg: Any) -> None:
            raise AssertionError("no other gateway process to send to")

    return GatewayPeers(_Nobody(), 0, "", itertools.count())
