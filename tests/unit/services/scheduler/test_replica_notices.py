"""A replica's notices to the router (services/scheduler/replica_notices.py), from a real
EngineCore with data parallelism on: cached blocks, ended requests, a new router, a lost worker."""

from __future__ import annotations

from common.config import Config
from common.prefix_hash import prefix_hashes
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


def test_the_router_hears_the_adapters_served() -> None:
    from common.messages import LoadLoraAdapter, LoraLoaded, UnloadLoraAdapter

    out = Outbox()
    config = Config().replace(
        scheduler={"async_scheduling": False},
        data_parallel={"data_parallel_size": 2},
        lora={"enable_lora": True},
    )
    core = EngineCore(config, out)
    core.on_worker_ready(_info())
    notices = NoticeBuilder(0)
    assert notices.build(core).lora_names == []  # type: ignore[union-attr]
    core.load_lora(LoadLoraAdapter(ticket=1, reply_to="gw", name="sql", path="/a"))
    assert notices.build(core) is None  # (loading: not served yet)
    core.on_lora_loaded(LoraLoaded(name="sql", weights_hash="h", rank=8))
    told = notices.build(core)
    assert told is not None and (told.lora_names, told.lora_hashes) == (["sql"], ["h"])
    assert notices.build(core) is None
    core.unload_lora(UnloadLoraAdapter(ticket=2, reply_to="gw", name="sql"))
    told = notices.build(core)
    assert told is not None and told.lora_names == []
