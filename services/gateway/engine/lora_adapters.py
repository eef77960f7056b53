"""The gateway's view of the LoRA adapters served, and the load/unload calls it makes.

Which adapters exist is the schedulers' fact: each replica's scheduler pushes LorasChanged
after every change (a load, an unload, a swap that dropped some, a worker restart); the
gateway keeps each replica's list and serves a `model` name that any replica has (the router
sends it to one that has it). An adapter being unloaded is refused here at once (404), before
the scheduler's answer. Load and unload go to every replica (a fan-out); the answer is the
first refusal, else 200.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator

from common.ipc import Sender
from common.messages import LoadLoraAdapter, LoraAdapterResult, LorasChanged, UnloadLoraAdapter
from services.gateway.engine.replicas import Replies


class LoraAdapters:
    """Adapters by name (what /v1/models lists and a request's `model` may name)."""

    def __init__(
        self,
        enabled: bool,
        scheduler: Sender,
        inbox_addr: str,
        num_replicas: int = 1,
        tickets: Iterator[int] | None = None,
    ) -> None:
        self.enabled = enabled
        self.scheduler = scheduler  # every replica's (a fan-out with several)
        self.inbox_addr = inbox_addr
        self.num_replicas = num_replicas
        self._tickets = tickets or itertools.count()
        self._by_replica: dict[int, dict[str, str]] = {}  # replica -> name -> folder
        self._unloading: set[str] = set()
        self._waiters: dict[int, Replies[LoraAdapterResult]] = {}

    @property
    def paths(self) -> dict[str, str]:
        """Every adapter served (by any replica), name -> its folder, sorted by name."""
        merged: dict[str, str] = {}
        for served in self._by_replica.values():
            merged.update(served)
        return {n: merged[n] for n in sorted(merged) if n not in self._unloading}

    def on_changed(self, msg: LorasChanged) -> None:
        self._by_replica[msg.replica] = dict(zip(msg.names, msg.paths, strict=True))

    async def load(
        self, name: str, path: str, base_model_name: str = "", timeout: float = 600.0
    ) -> LoraAdapterResult:
        ticket = next(self._tickets)
        msg = LoadLoraAdapter(
            ticket=ticket,
            reply_to=self.inbox_addr,
            name=name,
            path=path,
            base_model_name=base_model_name,
        )
        result = await self._ask(ticket, msg, timeout)
        if result.status == 200:  # (every replica has it; their LorasChanged may come later)
            for i in range(self.num_replicas):
                self._by_replica.setdefault(i, {})[name] = path
        return result

    async def unload(self, name: str, timeout: float = 600.0) -> LoraAdapterResult:
        """Refuse new requests for `name` at once; answer once every replica unloaded it
        (after its running requests finished)."""
        ticket = next(self._tickets)
        known = name in self.paths
        if known:
            self._unloading.add(name)
        try:
            msg = UnloadLoraAdapter(ticket=ticket, reply_to=self.inbox_addr, name=name)
            result = await self._ask(ticket, msg, timeout)
        finally:
            self._unloading.discard(name)
        if result.status == 200:  # (a replica's LorasChanged says so too, maybe later)
            for served in self._by_replica.values():
                served.pop(name, None)
        return result

    async def _ask(
        self, ticket: int, msg: LoadLoraAdapter | UnloadLoraAdapter, timeout: float
    ) -> LoraAdapterResult:
        replies: Replies[LoraAdapterResult] = Replies(self.num_replicas)
        self._waiters[ticket] = replies
        try:
            self.scheduler.send(msg)
            await asyncio.wait_for(replies.done.wait(), timeout)
        except TimeoutError:
            pass
        finally:
            self._waiters.pop(ticket, None)
        results = list(replies.items.values())
        refused = next((r for r in results if r.status != 200), None)
        if refused is not None:
            return refused
        if len(results) < self.num_replicas:
            missing = self.num_replicas - len(results)
            return LoraAdapterResult(ticket, msg.name, 503, f"{missing} replica(s) did not answer")
        return results[0]

    def on_result(self, msg: LoraAdapterResult) -> None:
        replies = self._waiters.get(msg.ticket)
        if replies is not None:
            replies.add(str(len(replies.items)), msg)
