"""Data parallelism's pieces with no processes: a replica's notices from a real EngineCore,
the gateway's merge of every replica's answers, /metrics labelled by replica, the layout."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from common.config import Config, ConfigError
from common.messages import SwapResult
from common.prefix_hash import prefix_hashes
from common.topology import (
    engine_entry_addr,
    replica_addrs,
    replica_config,
    replica_gpus,
    replica_name,
)
from services.gateway.engine.replicas import merge_request_rows, merge_stats, merge_swap_results
from services.gateway.http.metrics import _SchedulerStats
from services.scheduler.engine_core import EngineCore
from services.scheduler.replica_notices import NoticeBuilder
from tests.unit.services.scheduler.test_engine_core import Outbox, _info, _request, _run


def _dp_core() -> tuple[EngineCore, Outbox]:
    out = Outbox()
    config = Config().replace(
        scheduler={"async_scheduling": False}, data_parallel={"data_parallel_size": 2}
    )
    core = EngineCore(config, out)
    core.on_worker_ready(_info())
    return core, out


def test_notices_tell_cached_blocks_and_ended_requests() -> None:
    core, out = _dp_core()
    notices = NoticeBuilder(replica=1)
    first = notices.build(core)
    assert first is not None and first.reset and first.is_ready and first.replica == 1
    assert notices.build(core) is None  # nothing changed
    prompt = list(range(10, 23))  # 13 tokens, block size 4: 3 full blocks
    notices.received("a")
    core.add(_request("a", prompt=prompt))
    _run(core, out)
    notice = notices.build(core)
    assert notice is not None and not notice.reset
    assert notice.ended_request_ids == ["a"]
    assert served_root(core) == notice.cache_root
    assert list(prefix_hashes(notice.cache_root, prompt, 4)) == notice.cached_hashes[:3]


def test_a_new_router_hears_everything_again() -> None:
    core, out = _dp_core()
    notices = NoticeBuilder(0)
    notices.build(core)
    core.add(_request("a", prompt=list(range(10, 23))))
    _run(core, out)
    told = notices.build(core)
    assert told is not None and len(told.cached_hashes) == 3
    assert notices.build(core) is None
    notices.resync()
    again = notices.build(core)
    assert again is not None and again.reset and again.is_ready
    assert sorted(again.cached_hashes) == sorted(told.cached_hashes)


def served_root(core: EngineCore) -> int:
    assert core.served is not None
    return core.served.root


def test_a_rejected_request_is_reported_ended() -> None:
    core, _ = _dp_core()
    notices = NoticeBuilder(0)
    notices.build(core)
    notices.received("big")
    core.add(_request("big", prompt=list(range(200))))  # longer than max_model_len
    notice = notices.build(core)
    assert notice is not None and notice.ended_request_ids == ["big"]


def test_a_lost_worker_is_not_ready_then_a_new_pool_resets() -> None:
    core, _ = _dp_core()
    notices = NoticeBuilder(0)
    notices.build(core)
    notices.received("a")
    core.add(_request("a"))
    core.on_worker_down("the worker died")
    down = notices.build(core)
    assert down is not None and not down.is_ready and down.ended_request_ids == ["a"]
    core.on_worker_ready(_info(boot_id="boot-2"))
    up = notices.build(core)
    assert up is not None and up.is_ready and up.reset


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


def test_metrics_are_labelled_by_replica() -> None:
    collector = _SchedulerStats(lambda: "m")
    merged = merge_stats({"scheduler-0": _stats(), "scheduler-1": _stats()}, 2)
    merged["router"] = {"num_prefix_routed": 7, "num_least_loaded_routed": 3}
    collector.update(merged)
    families = {f.name: f for f in collector.collect()}
    hits = families["shuttle:prefix_cache_hits"]
    assert [(s.labels["replica"], s.value) for s in hits.samples if s.name.endswith("_total")] == [
        ("0", 40.0),
        ("1", 40.0),
    ]
    routed = families["shuttle:dp_routed_requests"]
    assert sorted((s.labels["how"], s.value) for s in routed.samples) == [
        ("least_loaded", 3.0),
        ("prefix", 7.0),
    ]


def test_one_replica_keeps_the_old_layout() -> None:
    config = Config().replace(server={"run_dir": "/run"})
    assert replica_name("scheduler", 0, 1) == "scheduler"
    assert replica_addrs(config, "scheduler") == ["ipc:///run/scheduler.sock"]
    assert engine_entry_addr(config) == "ipc:///run/scheduler.sock"


def test_several_replicas_have_their_own_addresses() -> None:
    config = Config().replace(server={"run_dir": "/run"}, data_parallel={"data_parallel_size": 2})
    assert engine_entry_addr(config) == "ipc:///run/router.sock"
    one = replica_config(config, 1)
    assert one.addr("scheduler") == "ipc:///run/scheduler-1.sock"
    assert one.addr("worker") == "ipc:///run/worker-1.sock"
    assert one.data_parallel.replica_index == 1


def test_explicit_addresses_must_name_every_replica() -> None:
    config = Config().replace(
        data_parallel={"data_parallel_size": 2, "scheduler_addrs": "tcp://s0:1,tcp://s1:1"}
    )
    assert replica_addrs(config, "scheduler") == ["tcp://s0:1", "tcp://s1:1"]
    short = config.replace(data_parallel={"worker_addrs": "tcp://w0:1"})
    with pytest.raises(ValueError):
        replica_addrs(short, "worker")


@pytest.mark.parametrize(
    "bad",
    [
        {"data_parallel_size": 0},
        {"dp_routing": "random"},
        {"dp_load_bound": 0.5},
        {"replica_index": 2, "data_parallel_size": 2},
    ],
)
def test_bad_settings_fail_at_start_up(bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        Config().replace(data_parallel=bad)


def test_replicas_split_the_gpus_or_share_them() -> None:
    assert replica_gpus(["0", "1", "2", "3"], 2) == [["0", "1"], ["2", "3"]]
    assert replica_gpus(["4", "7"], 2) == [["4"], ["7"]]
    assert replica_gpus(["0", "1", "2"], 2) == [["0"], ["1"]]
    assert replica_gpus(["0"], 2) == [["0"], ["0"]]


@pytest.mark.parametrize("visible", ["0,1", "0"])
def test_the_supervisor_gives_each_replica_its_gpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, visible: str
) -> None:
    from services import launch

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    config = Config().replace(
        server={"run_dir": str(tmp_path)},
        model={"device": "cuda"},
        cache={"gpu_memory_utilization": 0.8},
        data_parallel={"data_parallel_size": 2},
    )
    sup = launch.Supervisor(config)
    try:
        sup.write_replica_configs()
    finally:
        sup.inbox.close(linger=0)
    envs = [sup._env[f"worker-{i}"]["CUDA_VISIBLE_DEVICES"] for i in range(2)]
    utils = [
        Config.from_json((tmp_path / f"config-replica-{i}.json").read_bytes()).cache
        for i in range(2)
    ]
    if visible == "0,1":
        assert envs == ["0", "1"] and [u.gpu_memory_utilization for u in utils] == [0.8, 0.8]
    else:  # one GPU for both: each takes half of what one would
        assert envs == ["0", "0"] and [u.gpu_memory_utilization for u in utils] == [0.4, 0.4]


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
