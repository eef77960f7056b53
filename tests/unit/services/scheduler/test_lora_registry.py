"""LoRA adapters through a real EngineCore with no processes: load and unload flows, the
answers the gateway gets, requests naming adapters, the prefix cache's adapter roots (cache
isolation), a hot swap that drops adapters, a worker restart. A fake worker answers plans
(tests/unit/services/scheduler/test_engine_core.py's Outbox)."""

from __future__ import annotations

import dataclasses
from typing import Any

from common.config import Config
from common.messages import (
    LoadLora,
    LoadLoraAdapter,
    LoraAdapterResult,
    LoraLoaded,
    LorasChanged,
    ModelLoaded,
    RequestError,
    SamplingParams,
    StepPlan,
    SwapModel,
    TokenizedRequest,
    UnloadLora,
    UnloadLoraAdapter,
)
from services.scheduler.engine_core import EngineCore
from services.scheduler.engine_view import stats
from tests.unit.services.scheduler.test_engine_core import Outbox, _info, _run

PROMPT = list(range(10, 30))  # 20 tokens: 4 full blocks of 4 may be matched


def _core(modules: str = "", **lora: Any) -> tuple[EngineCore, Outbox]:
    out = Outbox()
    config = Config().replace(
        scheduler={"async_scheduling": False},
        lora={"enable_lora": True, "max_loras": 2, "lora_modules": modules, **lora},
    )
    core = EngineCore(config, out)
    core.on_worker_ready(_info())
    return core, out


def _request(rid: str, lora: str = "", max_tokens: int = 2) -> TokenizedRequest:
    return TokenizedRequest(
        request_id=rid,
        prompt_token_ids=PROMPT,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        eos_token_ids=[2],
        tokenizer_fingerprint="tok-a",
        lora_name=lora,
    )


def _load(core: EngineCore, out: Outbox, name: str, weights_hash: str = "h1") -> LoraAdapterResult:
    core.load_lora(LoadLoraAdapter(ticket=1, reply_to="gw", name=name, path=f"/a/{name}"))
    assert out.of(LoadLora)[-1] == LoadLora(name=name, path=f"/a/{name}")
    core.on_lora_loaded(LoraLoaded(name=name, weights_hash=weights_hash, rank=8))
    return out.of(LoraAdapterResult)[-1]


def _errors(out: Outbox) -> dict[str, RequestError]:
    return {e.request_id: e for e in out.of(RequestError)}


def test_load_answers_and_tells_the_gateway() -> None:
    core, out = _core()
    result = _load(core, out, "sql")
    assert (result.ticket, result.status, result.rank, result.weights_hash) == (1, 200, 8, "h1")
    assert out.of(LorasChanged)[-1] == LorasChanged(replica=0, names=["sql"], paths=["/a/sql"])
    again = LoadLoraAdapter(ticket=2, reply_to="gw", name="sql", path="/a/sql")
    core.load_lora(again)
    assert out.of(LoraAdapterResult)[-1].status == 400
    assert "already been loaded" in out.of(LoraAdapterResult)[-1].error


def test_a_refused_adapter_is_a_400_with_the_workers_reason() -> None:
    core, out = _core()
    core.load_lora(LoadLoraAdapter(ticket=3, reply_to="gw", name="bad", path="/a/bad"))
    error = "adapter_config.json: r: rank 64 is above --max-lora-rank 16"
    core.on_lora_loaded(LoraLoaded(name="bad", error=error))
    result = out.of(LoraAdapterResult)[-1]
    assert (result.ticket, result.status, result.error) == (3, 400, error)
    core.add(_request("r", "bad"))
    assert _errors(out)["r"].status == 404 and _errors(out)["r"].param == "model"


def test_base_model_name_must_match() -> None:
    core, out = _core()
    msg = LoadLoraAdapter(ticket=4, reply_to="gw", name="x", path="/a/x", base_model_name="zz")
    core.load_lora(msg)
    result = out.of(LoraAdapterResult)[-1]
    assert result.status == 400 and result.error.startswith("base_model_name:")
    assert not out.of(LoadLora)


def test_startup_adapters_load_when_the_worker_is_ready() -> None:
    core, out = _core(modules="a=/a/a b=/a/b")
    assert [m.name for m in out.of(LoadLora)] == ["a", "b"]
    assert not core.loras.is_settled
    core.add(_request("early", "a"))
    assert _errors(out)["early"].status == 503  # loading: retry shortly
    for name in ("a", "b"):
        core.on_lora_loaded(LoraLoaded(name=name, weights_hash=name, rank=4))
    assert core.loras.is_settled and out.of(LorasChanged)[-1].names == ["a", "b"]


def test_requests_carry_their_adapter_and_never_share_blocks() -> None:
    core, out = _core()
    _load(core, out, "A", "ha")
    _load(core, out, "B", "hb")
    for rid, lora in [("base1", ""), ("a1", "A"), ("b1", "B")]:
        core.add(_request(rid, lora))
        _run(core, out)
    plans = [p for p in out.of(StepPlan) if p.new_req_ids]
    assert [p.new_loras for p in plans] == [[], ["A"], ["B"]]
    s = stats(core)
    assert s["prefix_cache_hits"] == 0  # same prompt, three roots: nothing shared
    assert s["lora_adapters"]["A"]["num_cached_blocks"] == 5  # (20 + 1 tokens computed)
    assert s["lora_adapters"]["B"]["num_requests"] == 1
    for rid, lora in [("base2", ""), ("a2", "A")]:
        core.add(_request(rid, lora))
        _run(core, out)
    assert stats(core)["prefix_cache_hits"] == 2 * 16  # each hits its own blocks only


def test_reloaded_weights_miss_and_unload_waits_for_running_requests() -> None:
    core, out = _core()
    _load(core, out, "A", "h1")
    core.add(_request("a1", "A", max_tokens=4))
    core.step()  # a1 runs
    core.unload_lora(UnloadLoraAdapter(ticket=9, reply_to="gw", name="A"))
    assert not out.of(UnloadLora) and out.of(LorasChanged)[-1].names == []
    core.add(_request("late", "A"))
    assert _errors(out)["late"].status == 404  # refused at once, before it starts
    for plan in [
        p for p in out.of(StepPlan) if p.step_id in {s.step_id for s in core.window.in_flight}
    ]:
        core.on_step_result(out.answer(plan))
    _run(core, out)  # a1 finishes; then the adapter goes
    assert out.of(UnloadLora) == [UnloadLora(name="A")]
    assert out.of(LoraAdapterResult)[-1] == LoraAdapterResult(ticket=9, name="A", status=200)
    assert "A" not in stats(core)["lora_adapters"]
    assert core.policy is not None and core.policy.blocks.num_hashed_by_owner()["A"] == 0
    _load(core, out, "A", "h2")  # other weights under the same name
    core.add(_request("a2", "A"))
    _run(core, out)
    assert stats(core)["prefix_cache_hits"] == 0


def test_unknown_adapter_is_404_and_unload_of_unknown_is_404() -> None:
    core, out = _core()
    core.add(_request("r", "nope"))
    assert _errors(out)["r"].status == 404
    core.unload_lora(UnloadLoraAdapter(ticket=5, reply_to="gw", name="nope"))
    assert out.of(LoraAdapterResult)[-1].status == 404


def test_a_draft_model_refuses_adapter_requests_by_name_ngram_serves_them() -> None:
    for method, refused in [({"draft_model": "/d"}, True), ({"speculative": "ngram"}, False)]:
        out = Outbox()
        config = Config().replace(
            scheduler={"async_scheduling": False}, lora={"enable_lora": True}, speculative=method
        )
        core = EngineCore(config, out)
        core.on_worker_ready(_info())
        _load(core, out, "A")
        core.add(_request("r", "A"))
        if not refused:
            assert not out.of(RequestError)
            continue
        error = _errors(out)["r"]
        assert (error.status, error.param) == (400, "model") and "draft model" in error.message


def test_a_hot_swap_drops_adapters_of_another_base_model() -> None:
    core, out = _core()
    msg = LoadLoraAdapter(ticket=1, reply_to="gw", name="A", path="/a/A", base_model_name="v1")
    core.load_lora(msg)  # (the base named by its folder, /models/v1)
    core.on_lora_loaded(LoraLoaded(name="A", weights_hash="h", rank=4))
    _load(core, out, "any")  # no base_model_name: it stays
    core.swap(SwapModel(ticket=2, reply_to="gw", path="/models/v2", mode="drain"))
    core.step()
    core.add(_request("queued", "A"))  # accepted before the swap completes: waits (drain)
    core.on_model_loaded(ModelLoaded(version="v2", model=_info("v2")))
    assert _errors(out)["queued"].status == 400 and "dropped" in _errors(out)["queued"].message
    core.step()
    assert out.of(UnloadLora) == [UnloadLora(name="A")]
    assert out.of(LorasChanged)[-1].names == ["any"]


def test_a_new_worker_loads_every_adapter_again() -> None:
    core, out = _core()
    _load(core, out, "A")
    core.on_worker_ready(dataclasses.replace(_info(), boot_id="boot-2"))
    assert [m.name for m in out.of(LoadLora)] == ["A", "A"]
    assert not core.loras.is_settled


def test_adapters_the_worker_reports_are_served_without_loading_again() -> None:
    out = Outbox()
    config = Config().replace(
        scheduler={"async_scheduling": False},
        lora={"enable_lora": True, "lora_modules": "a=/a/a"},
    )
    core = EngineCore(config, out)
    info = _info(
        max_loras=2,
        lora_names=["a"],
        lora_paths=["/a/a"],
        lora_weights_hashes=["ha"],
        lora_ranks=[8],
    )
    core.on_worker_ready(info)
    assert not out.of(LoadLora) and core.loras.is_settled
    assert out.of(LorasChanged)[-1].names == ["a"]
    core.add(_request("r", "a"))
    _run(core, out)
    assert stats(core)["lora_adapters"]["a"]["weights_hash"] == "ha"


def test_an_in_process_runners_adapters_need_no_flag() -> None:
    out = Outbox()
    core = EngineCore(Config().replace(scheduler={"async_scheduling": False}), out)
    core.on_worker_ready(
        _info(
            max_loras=1,
            lora_names=["a"],
            lora_paths=["/a"],
            lora_weights_hashes=["h"],
            lora_ranks=[4],
        )
    )
    core.add(_request("r", "a"))
    assert not out.of(RequestError)


def test_an_unload_in_progress_ends_when_the_worker_restarts() -> None:
    core, out = _core()
    _load(core, out, "A")
    core.add(_request("a1", "A", max_tokens=4))
    core.step()
    core.unload_lora(UnloadLoraAdapter(ticket=7, reply_to="gw", name="A"))
    assert not out.of(UnloadLora)  # a1 still runs
    held = {"lora_names": ["A"], "lora_paths": ["/a/A"], "lora_weights_hashes": ["h1"]}
    core.on_worker_ready(_info(boot_id="boot-2", max_loras=2, lora_ranks=[8], **held))
    assert out.of(UnloadLora) == [UnloadLora(name="A")]  # (the new worker had it)
    assert out.of(LoraAdapterResult)[-1] == LoraAdapterResult(ticket=7, name="A", status=200)
    assert "A" not in core.loras.adapters


def test_a_swap_drops_the_adapters_the_new_model_does_not_fit() -> None:
    core, out = _core()
    _load(core, out, "fits")
    _load(core, out, "misfit")
    core.swap(SwapModel(ticket=2, reply_to="gw", path="/models/v2", mode="drain"))
    core.step()
    core.add(_request("queued", "misfit"))
    held = {"lora_names": ["fits"], "lora_paths": ["/a/fits"], "lora_weights_hashes": ["h1"]}
    core.on_model_loaded(ModelLoaded(version="v2", model=_info("v2", max_loras=2, **held)))
    assert _errors(out)["queued"].status == 400
    core.step()
    assert out.of(UnloadLora) == [UnloadLora(name="misfit")]
    assert out.of(LorasChanged)[-1].names == ["fits"]
