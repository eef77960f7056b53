"""The gateway's adapter registry (services/gateway/engine/lora_adapters.py): what the
schedulers push, the fan-out of loads and unloads to every replica and their merged answer,
and an unloading adapter refused at once."""

from __future__ import annotations

import asyncio
from typing import Any

from common.messages import LoadLoraAdapter, LoraAdapterResult, LorasChanged, UnloadLoraAdapter
from services.gateway.engine.lora_adapters import LoraAdapters


class Replicas:
    """A fan-out to `n` schedulers that answer each load or unload with `statuses`."""

    def __init__(self, n: int, statuses: list[int]) -> None:
        self.n, self.statuses = n, statuses
        self.sent: list[Any] = []
        self.adapters: LoraAdapters | None = None

    def send(self, msg: LoadLoraAdapter | UnloadLoraAdapter) -> None:
        self.sent.append(msg)
        loop = asyncio.get_running_loop()
        for status in self.statuses:
            result = LoraAdapterResult(msg.ticket, msg.name, status, "" if status == 200 else "no")
            assert self.adapters is not None
            loop.call_soon(self.adapters.on_result, result)


def _adapters(statuses: list[int]) -> tuple[LoraAdapters, Replicas]:
    replicas = Replicas(len(statuses), statuses)
    adapters = LoraAdapters(True, replicas, "inproc://gw", num_replicas=len(statuses))  # type: ignore[arg-type]
    replicas.adapters = adapters
    return adapters, replicas


def test_pushed_lists_are_merged_over_replicas() -> None:
    adapters, _ = _adapters([200, 200])
    adapters.on_changed(LorasChanged(replica=0, names=["b", "a"], paths=["/b", "/a"]))
    adapters.on_changed(LorasChanged(replica=1, names=["c"], paths=["/c"]))
    assert adapters.paths == {"a": "/a", "b": "/b", "c": "/c"}
    adapters.on_changed(LorasChanged(replica=0, names=[], paths=[]))
    assert adapters.paths == {"c": "/c"}


def test_a_load_is_served_as_soon_as_every_replica_said_yes() -> None:
    adapters, replicas = _adapters([200, 200])
    result = asyncio.run(adapters.load("sql", "/a/sql"))
    assert result.status == 200 and adapters.paths == {"sql": "/a/sql"}
    (sent,) = replicas.sent
    assert isinstance(sent, LoadLoraAdapter) and sent.reply_to == "inproc://gw"


def test_one_replicas_refusal_is_the_answer() -> None:
    adapters, _ = _adapters([200, 400])
    assert asyncio.run(adapters.load("sql", "/a/sql")).status == 400
    assert adapters.paths == {}


def test_an_unloading_adapter_is_refused_before_the_answer() -> None:
    adapters, replicas = _adapters([200])
    adapters.on_changed(LorasChanged(replica=0, names=["sql"], paths=["/a/sql"]))
    seen: list[dict[str, str]] = []
    replicas.send = lambda msg: seen.append(adapters.paths)  # type: ignore[method-assign]

    async def go() -> LoraAdapterResult:
        return await adapters.unload("sql", timeout=0.01)

    result = asyncio.run(go())
    assert seen == [{}]  # gone from the names while the unload was in flight
    assert result.status == 503  # (no replica answered within the timeout)
