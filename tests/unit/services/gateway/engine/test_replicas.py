"""The gateway's merge of every replica's answers (services/gateway/engine/replicas.py) and
the ZeroMQ client gathering every replica and the router."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from common.messages import SwapResult
from services.gateway.engine.replicas import merge_request_rows, merge_stats, merge_swap_results


def _stats(**kw: Any) -> dict[str, Any]:
    return {
        "ready": True,
        "num_running": 1,
        "num_waiting": 2,
        "num_total_blocks": 10,
        "num_used_blocks": 5,
        "prefix_cache_queries": 100,
        "prefix_cache_hits": 40,
        "request_ids": ["a"],
        "version": "v1",
        "swap": None,
        **kw,
    }


def test_stats_add_up_and_keep_each_replica() -> None:
    merged = merge_stats(
        {"scheduler-0": _stats(), "scheduler-1": _stats(num_used_blocks=0, request_ids=["b"])}, 2
    )
    assert merged["num_running"] == 2 and merged["prefix_cache_hits"] == 80
    assert merged["kv_cache_usage"] == pytest.approx(5 / 20)
    assert merged["request_ids"] == ["a", "b"] and merged["version"] == "v1"
    assert [r["replica"] for r in merged["replicas"]] == [0, 1]


def test_lora_adapter_counts_add_up() -> None:
    row = {"state": "ready", "num_requests": 2, "num_live_requests": 1, "num_cached_blocks": 3}
    merged = merge_stats(
        {
            "scheduler-0": _stats(lora_adapters={"sql": row}),
            "scheduler-1": _stats(lora_adapters={"sql": row, "chat": row}),
        },
        2,
    )
    assert merged["lora_adapters"]["sql"] == {
        "state": "ready",
        "num_requests": 4,
        "num_live_requests": 2,
        "num_cached_blocks": 6,
    }
    assert merged["lora_adapters"]["chat"] == row


def test_a_replica_that_does_not_answer_is_not_ready() -> None:
    merged = merge_stats({"scheduler-1": _stats()}, 2)
    assert merged["ready"] and merged["replicas"][0] == {"replica": 0, "ready": False}
    assert merged["num_running"] == 1


def test_listings_are_tagged_with_their_replica() -> None:
    rows = merge_request_rows(
        {
            "scheduler-1": {"requests": [{"id": "b", "arrival_time": 1.0}]},
            "scheduler-0": {"requests": [{"id": "a", "arrival_time": 2.0}]},
        }
    )["requests"]
    assert [(r["id"], r["replica"]) for r in rows] == [("b", 1), ("a", 0)]


def test_a_swap_succeeds_when_every_replica_swapped() -> None:
    ok = SwapResult(ticket=1, ok=True, version="v2", previous_version="v1", duration_s=2.0)
    bad = SwapResult(ticket=1, ok=False, error="no room")
    assert merge_swap_results([ok, ok], 2).ok
    assert merge_swap_results([ok, ok], 2).version == "v2"
    both = merge_swap_results([ok, bad], 2)
    assert not both.ok and "no room" in both.error
    assert not merge_swap_results([ok], 2).ok


async def _sent(box: Any, n: int) -> None:
    """Until the client has sent `n` messages through `box` (its tasks run in turn)."""
    while len(box.sent) < n:
        await asyncio.sleep(0)


def test_the_gateway_gathers_every_replica_and_the_router() -> None:
    from common.messages import Stats, StatsQuery, SwapResult
    from services.gateway.engine.zmq_client import ZmqEngineClient
    from tests.unit.services.gateway.engine.test_zmq_client import FakeOutbox

    schedulers, router = FakeOutbox(), FakeOutbox()
    client = ZmqEngineClient(
        FakeOutbox(),  # type: ignore[arg-type]
        schedulers,
        "inproc://gateway",
        num_replicas=2,
        router=router,
    )

    async def run() -> tuple[dict[str, Any], SwapResult]:
        task = asyncio.create_task(client.stats())
        await _sent(schedulers, 1)
        await _sent(router, 1)
        (query,) = schedulers.sent
        (routing,) = router.sent
        assert isinstance(query, StatsQuery) and isinstance(routing, StatsQuery)
        for i in range(2):
            client.on_stats(Stats(name=f"scheduler-{i}", query_id=query.query_id, data=_stats()))
        client.on_stats(Stats(name="router", query_id=routing.query_id, data={"n": 1}))
        stats = await task
        swap = asyncio.create_task(client.swap_model("/m", "v2", "overlap"))
        await _sent(schedulers, 2)
        ticket = schedulers.sent[-1].ticket
        for _ in range(2):
            client.on_swap_result(SwapResult(ticket=ticket, ok=True, version="v2"))
        return stats, await swap

    stats, swap = asyncio.run(run())
    assert stats["num_running"] == 2 and stats["router"] == {"n": 1}
    assert swap.ok and swap.version == "v2"


def test_a_replica_that_never_answers_times_out_to_not_ready() -> None:
    from common.messages import Stats
    from services.gateway.engine.zmq_client import ZmqEngineClient
    from tests.unit.services.gateway.engine.test_zmq_client import FakeOutbox

    schedulers = FakeOutbox()
    client = ZmqEngineClient(FakeOutbox(), schedulers, "inproc://g", num_replicas=2)  # type: ignore[arg-type]

    async def run() -> dict[str, Any]:
        task = asyncio.create_task(client.stats(timeout=0.05))
        await _sent(schedulers, 1)
        qid = schedulers.sent[0].query_id
        client.on_stats(Stats(name="scheduler-1", query_id=qid, data=_stats()))
        return await task

    stats = asyncio.run(run())
    assert [r["ready"] for r in stats["replicas"]] == [False, True]
