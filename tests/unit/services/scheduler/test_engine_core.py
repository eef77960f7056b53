"""EngineCore with no processes and no model: the served model, hot-swap states (overlap and
drain, a tokenizer that changes), worker restarts, aborts (intake: test_intake.py; what the
detokenizer hears: test_detok_messages.py). A fake worker answers each plan: every sequence
that reaches its last known token samples token 7."""

from __future__ import annotations

import dataclasses
from typing import Any

from common.config import Config
from common.messages import (
    DetokNew,
    FinishReason,
    LoadModel,
    ModelChanged,
    ModelInfo,
    ModelLoaded,
    RequestError,
    Retokenize,
    SamplingParams,
    StepPlan,
    StepResult,
    SwapModel,
    SwapResult,
    TokenBatch,
    TokenizedRequest,
    UnloadModel,
)
from services.scheduler.engine_core import EngineCore
from services.scheduler.engine_view import request_rows
from services.scheduler.intake import sequence_key
from services.scheduler.outbox import ToDetokenizer, ToGateway, ToWorker

TOKEN = 7


def _info(
    version: str = "v1", fingerprint: str = "tok-a", boot_id: str = "boot-1", **kw: Any
) -> ModelInfo:
    fields: dict[str, Any] = {
        "model_type": "llama",
        "num_layers": 2,
        "num_kv_heads": 1,
        "head_dim": 8,
        "dtype": "float32",
        "num_blocks": 64,
        "block_size": 4,
        "max_model_len": 128,
        "weights_version": version,
        "model_name": "m",
        "model_path": f"/models/{version}",
        "boot_id": boot_id,
        "eos_token_ids": [2],
        "vocab_size": 100,
        "tokenizer_fingerprint": fingerprint,
    }
    return ModelInfo(**(fields | kw))


@dataclasses.dataclass
class Outbox:
    """Records what the core sends, in order, and plays a worker that samples at once."""

    sent: list[tuple[str, Any]] = dataclasses.field(default_factory=list)
    known: dict[str, int] = dataclasses.field(default_factory=dict)  # seq key -> tokens known

    def to_worker(self, msg: ToWorker) -> None:
        self.sent.append(("worker", msg))

    def to_detokenizer(self, msg: ToDetokenizer) -> None:
        self.sent.append(("detokenizer", msg))

    def to_gateway(self, msg: ToGateway) -> None:
        self.sent.append(("gateway", msg))

    def announce(self, msg: ModelChanged) -> None:
        self.sent.append(("all", msg))

    def reply(self, address: str, msg: SwapResult) -> None:
        self.sent.append((address, msg))

    def of(self, kind: type) -> list[Any]:
        return [m for _, m in self.sent if isinstance(m, kind)]

    def answer(self, plan: StepPlan) -> StepResult:
        for rid, prompt in zip(plan.new_req_ids, plan.new_prompt_token_ids, strict=True):
            self.known[rid] = len(prompt)
        sampled = []
        for rid, done, new in zip(
            plan.req_ids, plan.num_computed_tokens, plan.num_new_tokens, strict=True
        ):
            if done + new == self.known[rid]:
                sampled.append(rid)
                self.known[rid] += 1
        return StepResult(step_id=plan.step_id, req_ids=sampled, token_ids=[TOKEN] * len(sampled))


def _core(info: ModelInfo | None = None, **scheduler: Any) -> tuple[EngineCore, Outbox]:
    out = Outbox()
    config = Config().replace(scheduler={"async_scheduling": False, **scheduler})
    core = EngineCore(config, out)
    core.on_worker_ready(info or _info())
    return core, out


def _request(
    rid: str,
    n: int = 1,
    max_tokens: int = 3,
    fingerprint: str = "tok-a",
    prompt: list[int] | None = None,
) -> TokenizedRequest:
    return TokenizedRequest(
        request_id=rid,
        prompt_token_ids=prompt or [10, 11, 12, 13, 14],
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, n=n),
        eos_token_ids=[2],
        tokenizer_fingerprint=fingerprint,
    )


def _run(core: EngineCore, out: Outbox, max_steps: int = 100) -> None:
    """Step until nothing is left to plan or wait for (the worker answers at once)."""
    for _ in range(max_steps):
        core.step()
        waiting = {s.step_id for s in core.window.in_flight}
        pending = [p for p in out.of(StepPlan) if p.step_id in waiting]
        if not pending:
            return
        for plan in pending:
            core.on_step_result(out.answer(plan))
    raise AssertionError("the engine did not finish")


def _tokens(out: Outbox) -> dict[tuple[str, int], list[int]]:
    got: dict[tuple[str, int], list[int]] = {}
    for batch in out.of(TokenBatch):
        for rid, i, ids in zip(batch.request_ids, batch.seq_indices, batch.token_ids, strict=True):
            got.setdefault((rid, i), []).extend(ids)
    return got


def test_first_ready_announces_the_served_model() -> None:
    core, out = _core()
    (changed,) = out.of(ModelChanged)
    assert (changed.name, changed.version, changed.tokenizer_fingerprint) == ("m", "v1", "tok-a")
    assert (changed.path, changed.vocab_size, changed.max_model_len) == ("/models/v1", 100, 128)
    assert core.is_ready and not core.has_work


def test_plans_carry_the_stop_ids_min_tokens_masks() -> None:
    core, out = _core()
    plain = _request("plain")
    masked = dataclasses.replace(
        _request("masked"),
        sampling=SamplingParams(max_tokens=3, min_tokens=2, stop_token_ids=[9, 5]),
    )
    ignoring = dataclasses.replace(
        _request("ignoring"),
        sampling=SamplingParams(max_tokens=3, min_tokens=2, stop_token_ids=[9], ignore_eos=True),
    )
    core.add(plain)
    core.step()
    (first,) = out.of(StepPlan)
    assert first.new_req_ids == [sequence_key("plain", 0)]
    assert first.new_stop_token_ids == []  # no new request has min_tokens
    core.on_step_result(out.answer(first))
    core.add(masked)
    core.add(ignoring)
    core.step()
    second = out.of(StepPlan)[-1]
    stops = dict(zip(second.new_req_ids, second.new_stop_token_ids, strict=True))
    # EOS (2) unless ignore_eos, with the request's stop_token_ids
    assert stops == {sequence_key("masked", 0): [2, 5, 9], sequence_key("ignoring", 0): [9]}


def test_a_dead_gateway_process_s_requests_end_and_the_others_run_on() -> None:
    core, out = _core()
    for rid in ("g0:a", "g1:b", "g0:c"):  # wire ids of gateway-0 and gateway-1
        core.add(_request(rid, max_tokens=50))
    core.step()
    assert core.abort_owned_by(0, num_gateways=2) == 2
    ended = out.of(TokenBatch)[-1]
    assert sorted(ended.request_ids) == ["g0:a", "g0:c"]
    assert set(ended.finish_reasons) == {int(FinishReason.CANCELLED)}
    assert list(core.groups) == ["g1:b"]


def test_abort_ends_every_sequence_or_one() -> None:
    core, out = _core()
    core.add(_request("a", n=3, max_tokens=50))
    core.add(_request("b", n=2, max_tokens=50))
    core.step()
    core.abort(["a"], FinishReason.STOP, seq_indices=[1])  # a stop string in sequence 1
    last = out.of(TokenBatch)[-1]
    assert (last.request_ids, last.seq_indices) == (["a"], [1])
    assert last.finish_reasons == [int(FinishReason.STOP)]
    assert {r.seq_index for r in core.groups["a"] if not r.is_finished} == {0, 2}
    core.abort(["a", "b"], FinishReason.CANCELLED)
    ended = out.of(TokenBatch)[-1]
    assert sorted(zip(ended.request_ids, ended.seq_indices, strict=True)) == [
        ("a", 0),
        ("a", 2),
        ("b", 0),
        ("b", 1),
    ]
    assert not core.groups
    core.abort(["a"], FinishReason.CANCELLED)  # idempotent
    assert out.of(TokenBatch)[-1] is ended
    _run(core, out)
    core.policy.check_idle()


def test_a_restarted_worker_fails_live_requests_and_resets_the_pool() -> None:
    core, out = _core()
    core.add(_request("a", max_tokens=50))
    core.step()
    first = core.policy
    core.on_worker_ready(_info())  # the answer to our own Reset, while busy: a restart?
    assert core.policy is not first  # same boot id but requests in flight: start over
    (err,) = out.of(RequestError)
    assert (err.request_id, err.status) == ("a", 503)
    forget = out.of(TokenBatch)[-1]
    assert forget.finish_reasons == [int(FinishReason.ERROR)]
    assert not core.groups and not core.window.in_flight
    quiet = core.policy
    core.on_worker_ready(_info())  # idle, same boot id: nothing changes
    assert core.policy is quiet
    core.on_worker_ready(_info(boot_id="boot-2"))  # a new process: a new pool
    assert core.policy is not quiet and core.policy.blocks.num_free_blocks == 64
    assert len(out.of(ModelChanged)) == 3


def test_a_dead_worker_refuses_new_requests_until_the_next_ready() -> None:
    core, out = _core()
    core.add(_request("a", max_tokens=50))
    core.step()
    core.on_worker_down("the worker process restarted")
    assert not core.is_ready
    core.add(_request("b"))
    assert [(e.request_id, e.status) for e in out.of(RequestError)] == [("a", 503), ("b", 503)]
    core.on_step_result(StepResult(step_id=1, req_ids=[sequence_key("a", 0)], token_ids=[7]))
    core.on_worker_ready(_info(boot_id="boot-2"))
    core.add(_request("c"))
    _run(core, out)
    assert _tokens(out)[("c", 0)] == [TOKEN] * 3


def _swap(core: EngineCore, mode: str, version: str = "v2") -> None:
    core.swap(
        SwapModel(ticket=1, reply_to="gw", path=f"/models/{version}", version=version, mode=mode)
    )


def test_overlap_swap_starts_new_requests_on_the_new_version() -> None:
    core, out = _core()
    core.add(_request("old", max_tokens=20))
    core.step()
    _swap(core, "overlap")
    (load,) = out.of(LoadModel)
    assert (load.mode, load.version) == ("overlap", "v2")
    core.on_model_loaded(ModelLoaded(version="v2", model=_info("v2")))
    assert out.of(ModelChanged)[-1].version == "v2"
    assert not out.of(SwapResult)  # the old version still serves "old"
    core.add(_request("new"))
    _run(core, out)
    rows = {r["id"]: r for r in request_rows(core)["requests"]}
    assert not rows
    versions = {
        rid: v for b in out.of(TokenBatch) for rid, v in zip(b.request_ids, b.versions, strict=True)
    }
    assert versions == {"old": "v1", "new": "v2"}
    assert out.of(UnloadModel)[0].version == "v1"
    (result,) = out.of(SwapResult)
    assert result.ok and (result.previous_version, result.version) == ("v1", "v2")
    kinds = [type(m) for _, m in out.sent]
    assert kinds.index(ModelChanged, 1) < kinds.index(SwapResult)  # the gateway knows first


def test_drain_swap_waits_for_started_requests_and_holds_queued_ones() -> None:
    core, out = _core()
    core.add(_request("running", max_tokens=5))
    core.step()
    _swap(core, "drain")
    core.add(_request("queued"))
    assert not out.of(LoadModel)
    _run(core, out)  # "running" finishes; "queued" may not start while draining
    (load,) = out.of(LoadModel)
    assert load.mode == "drain"
    assert ("queued", 0) not in _tokens(out)
    core.on_model_loaded(ModelLoaded(version="v2", model=_info("v2", num_blocks=32)))
    assert core.policy.blocks.num_blocks == 32  # another layout: the pool was rebuilt
    _run(core, out)
    assert _tokens(out)[("queued", 0)] == [TOKEN] * 3
    assert out.of(SwapResult)[0].ok


def test_a_drain_onto_a_new_pool_forgets_the_old_pools_prefixes() -> None:
    """A drain swap (or a failed one, which rebuilds the old model) gives the worker a new,
    empty KV pool of the same layout: the prefixes cached in the old pool are forgotten, or
    the same version's root would find blocks that hold nothing any more."""
    long_prompt = list(range(10, 30))
    core, out = _core(_info(kv_pool_id="pool-1"))
    core.add(_request("first", prompt=long_prompt))
    _run(core, out)
    assert core.policy.blocks.num_cached_blocks > 0
    _swap(core, "drain", version="v1")
    _run(core, out)
    rebuilt = _info(kv_pool_id="pool-2")
    core.on_model_loaded(ModelLoaded(version="v1", error="OSError: bad folder", model=rebuilt))
    assert core.policy.blocks.num_cached_blocks == 0
    assert not out.of(SwapResult)[-1].ok
    core.add(_request("again", prompt=long_prompt))
    _run(core, out)
    assert core.policy.blocks.num_cached_blocks > 0  # cached again, in the new pool
    _swap(core, "overlap", version="v2")  # the same pool: its prefixes stay
    core.on_model_loaded(ModelLoaded(version="v2", model=_info("v2", kv_pool_id="pool-2")))
    assert core.policy.blocks.num_cached_blocks > 0


def test_a_new_tokenizer_sends_unstarted_requests_back_to_be_tokenised() -> None:
    core, out = _core()
    core.add(_request("started", n=2, max_tokens=20))
    core.step()
    _swap(core, "overlap")
    core.on_model_loaded(ModelLoaded(version="v2", model=_info("v2", fingerprint="tok-b")))
    core.add(_request("late", fingerprint="tok-a"))  # tokenised before the tokenizers knew
    assert [m.request_id for m in out.of(Retokenize)] == ["late"]
    core.add(_request("fresh", fingerprint="tok-b"))
    _run(core, out)
    got = _tokens(out)
    assert got[("started", 0)] == got[("started", 1)] == [TOKEN] * 20
    assert got[("fresh", 0)] == [TOKEN] * 3 and ("late", 0) not in got
    assert out.of(DetokNew)[-1].tokenizers == ["tok-b"]


def test_drain_to_a_new_tokenizer_retokenises_the_queue() -> None:
    core, out = _core()
    core.add(_request("running", max_tokens=5))
    core.step()
    _swap(core, "drain")
    core.add(_request("queued", n=2))
    _run(core, out)
    core.on_model_loaded(ModelLoaded(version="v2", model=_info("v2", fingerprint="tok-b")))
    assert [m.request_id for m in out.of(Retokenize)] == ["queued"]
    forget = out.of(TokenBatch)[-1]  # the detokenizer forgets both sequences silently
    assert forget.request_ids == ["queued"] * 2
    assert forget.finish_reasons == [int(FinishReason.ERROR)] * 2
    assert not core.groups and not core.policy.requests
    assert out.of(SwapResult)[0].ok


def test_a_failed_load_keeps_the_old_model() -> None:
    core, out = _core()
    _swap(core, "overlap")
    core.on_model_loaded(ModelLoaded(version="v2", error="OSError: no tokenizer"))
    (result,) = out.of(SwapResult)
    assert not result.ok and "tokenizer" in result.error
    assert len(out.of(ModelChanged)) == 1 and core.policy.version == "v1"
