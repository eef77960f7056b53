"""The scheduler's part of the prefill/decode hand-over (services/scheduler/handover.py), on
two real EngineCores (a prefill and a decode replica) with no processes: a fake worker
answers each plan (every sequence at its last known token samples 7; an export answers
bytes, an import lands unless told otherwise), and a hand-over goes straight from one core
to the other. Blocks are checked after every scenario: none used, the pool consistent."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import pytest

from common.config import Config
from common.messages import (
    FinishReason,
    KvExported,
    KvHandover,
    LoadModel,
    ModelLoaded,
    RequestError,
    StepPlan,
    StepResult,
    SwapModel,
    TokenBatch,
    TokenizedRequest,
)
from common.model_facts import lora_root
from services.scheduler import handover
from services.scheduler.block_manager import BlockManager
from services.scheduler.engine_core import EngineCore
from tests.unit.services.scheduler.test_engine_core import Outbox, _info, _request, _tokens


class Worker(Outbox):
    """Outbox's worker, plus the hand-over's answers (bytes out, imports landed)."""

    failing: set[int] = set()  # import destinations that fail their checks

    def answer(self, plan: StepPlan) -> StepResult:
        result = super().answer(plan)
        return StepResult(
            step_id=result.step_id,
            req_ids=result.req_ids,
            token_ids=result.token_ids,
            kv_export_data=[f"block-{k}" for k in plan.kv_export_keys],
            kv_import_failed_dst=[b for b in plan.kv_import_dst if b in self.failing],
        )


def _pair(
    loras: tuple[dict[str, str], dict[str, str]] = ({}, {}),
) -> tuple[EngineCore, Worker, list[KvHandover], EngineCore, Worker]:
    """A prefill and a decode core; `loras`: the adapters each worker holds (name -> weights
    hash), with --enable-lora when any."""
    sent: list[KvHandover] = []
    dp: dict[str, Any] = {"prefill_replicas": 1, "decode_replicas": 1, "kv_transfer": "tcp"}
    cores = []
    for index in (0, 1):
        out = Worker()
        held = loras[index]
        config = Config().replace(
            scheduler={"async_scheduling": False},
            data_parallel={**dp, "replica_index": index},
            lora={"enable_lora": any(loras)},
        )
        core = EngineCore(config, out, to_router=sent.append if index == 0 else None)
        core.on_worker_ready(
            _info(
                lora_names=list(held),
                lora_paths=[f"/adapters/{n}" for n in held],
                lora_weights_hashes=list(held.values()),
                lora_ranks=[4] * len(held),
                max_loras=2 if any(loras) else 0,
            )
        )
        cores.append((core, out))
    (prefill, p_out), (decode, d_out) = cores
    return prefill, p_out, sent, decode, d_out


def _step_once(core: EngineCore, out: Worker) -> None:
    """Plan what can be planned and answer it."""
    core.step()
    waiting = {s.step_id for s in core.window.in_flight}
    for plan in [p for p in out.of(StepPlan) if p.step_id in waiting]:
        core.on_step_result(out.answer(plan))


def _run(core: EngineCore, out: Worker) -> None:
    for _ in range(100):
        _step_once(core, out)
        if not core.has_work:
            return
    raise AssertionError("the engine did not finish")


def _settled(core: EngineCore) -> None:
    assert core.policy is not None and core.handover is not None
    assert not core.handover.busy and not core.groups
    assert core.policy.blocks.num_used_blocks == 0
    core.policy.check_integrity()
    core.policy.check_idle()


def _blocks(core: EngineCore) -> BlockManager:
    assert core.policy is not None
    return core.policy.blocks


PROMPT = list(range(10, 20))  # 10 tokens, blocks of 4: 2 full blocks and a tail of 2


def test_a_request_prefills_on_one_replica_and_decodes_on_the_other() -> None:
    prefill, p_out, sent, decode, d_out = _pair()
    prefill.add(_request("r", max_tokens=5, prompt=PROMPT))
    _run(prefill, p_out)
    (first,) = p_out.of(TokenBatch)
    assert first.token_ids == [[7]] and first.finish_reasons == [int(FinishReason.NONE)]
    (msg,) = sent
    assert (msg.request_id, msg.seq_index, msg.output_token_ids) == ("r", 0, [7])
    # its 2 full blocks, and its partial last one (the tail's own: never cached)
    assert msg.block_tokens == [PROMPT[:4], PROMPT[4:8], PROMPT[8:]]
    assert msg.block_data == [f"block-{k}" for k in msg.block_keys]
    (export,) = [p for p in p_out.of(StepPlan) if p.kv_export_src]
    assert export.kv_export_keys == msg.block_keys and export.kv_export_paths == [""] * 3
    _settled(prefill)

    decode.on_handover(msg)
    _run(decode, d_out)
    (imp,) = [p for p in d_out.of(StepPlan) if p.kv_import_dst]
    assert imp.kv_import_keys == msg.block_keys and imp.kv_import_data == msg.block_data
    (new,) = [p for p in d_out.of(StepPlan) if p.new_req_ids]
    assert new.new_num_output_tokens == [1]  # a resumed sequence: its first token known
    assert new.num_computed_tokens == [10]  # the imported blocks: only its first token left
    assert new.new_block_ids[0][2] == imp.kv_import_dst[2]  # (the tail ends its table)
    assert _tokens(d_out)[("r", 0)] == [7] * 4  # 5 in all, the first from the prefill side
    assert d_out.of(TokenBatch)[-1].finish_reasons == [int(FinishReason.LENGTH)]
    assert _blocks(decode).num_cached_blocks >= 2  # registered in its prefix cache
    _settled(decode)

    decode.on_handover(msg)  # the same full blocks again: found cached; its tail moves
    _run(decode, d_out)
    imports = [p.kv_import_keys for p in d_out.of(StepPlan) if p.kv_import_dst]
    assert imports == [msg.block_keys, msg.block_keys[2:]]
    _settled(decode)


def test_a_block_that_fails_on_arrival_is_recomputed() -> None:
    prefill, p_out, sent, decode, d_out = _pair()
    prefill.add(_request("r", max_tokens=3, prompt=PROMPT))
    _run(prefill, p_out)
    d_out.failing = {0, 1, 2, 3, 4, 5, 6, 7}
    decode.on_handover(sent[0])
    _run(decode, d_out)
    (new,) = [p for p in d_out.of(StepPlan) if p.new_req_ids]
    assert new.num_computed_tokens == [0]  # nothing landed: the prompt is computed again
    assert decode.handover is not None and decode.handover.stats.blocks_failed == 3
    _settled(decode)


def test_a_one_token_request_stays_on_the_prefill_replica() -> None:
    prefill, p_out, sent, _, _ = _pair()
    prefill.add(_request("one", max_tokens=1, prompt=PROMPT))
    _run(prefill, p_out)
    assert not sent and p_out.of(TokenBatch)[-1].finish_reasons == [int(FinishReason.LENGTH)]
    _settled(prefill)


def test_n_sequences_are_handed_over_one_by_one() -> None:
    prefill, p_out, sent, decode, d_out = _pair()
    prefill.add(_request("r", n=3, max_tokens=4, prompt=PROMPT))
    _run(prefill, p_out)
    assert sorted(m.seq_index for m in sent) == [0, 1, 2]
    _settled(prefill)
    for msg in sent:
        decode.on_handover(msg)
    _run(decode, d_out)
    assert {k: len(v) for k, v in _tokens(d_out).items()} == {("r", i): 3 for i in range(3)}
    _settled(decode)


def test_a_cancel_during_the_export_sends_nothing() -> None:
    prefill, p_out, sent, _, _ = _pair()
    prefill.add(_request("r", max_tokens=5, prompt=PROMPT))
    while not (prefill.handover and prefill.handover.pending.exports):
        _step_once(prefill, p_out)
    prefill.abort(["r"], FinishReason.CANCELLED)
    assert p_out.of(TokenBatch)[-1].finish_reasons == [int(FinishReason.CANCELLED)]
    _run(prefill, p_out)
    assert not sent
    _settled(prefill)


def test_a_cancel_on_the_way_or_during_the_import_frees_everything() -> None:
    prefill, p_out, sent, decode, d_out = _pair()
    for rid in ("a", "b"):
        prefill.add(_request(rid, max_tokens=5, prompt=PROMPT))
    _run(prefill, p_out)
    on_the_way, importing = sent
    decode.abort(["a"], FinishReason.CANCELLED)  # before its hand-over arrives
    decode.on_handover(on_the_way)
    assert d_out.of(TokenBatch)[-1].finish_reasons == [int(FinishReason.CANCELLED)]
    decode.on_handover(importing)
    decode.step()  # the import is planned ...
    assert _blocks(decode).num_used_blocks == 3
    decode.abort(["b"], FinishReason.CANCELLED)  # ... and cancelled before it lands
    assert d_out.of(TokenBatch)[-1].request_ids == ["b"]
    _run(decode, d_out)
    assert not [p for p in d_out.of(StepPlan) if p.new_req_ids]
    assert _blocks(decode).num_cached_blocks == 2  # (the landed full blocks stay cached)
    _settled(decode)


def test_a_hand_over_of_another_version_is_refused_retryably() -> None:
    prefill, p_out, sent, decode, d_out = _pair()
    prefill.add(_request("r", max_tokens=5, prompt=PROMPT))
    _run(prefill, p_out)
    decode.on_worker_ready(_info(version="v2", boot_id="boot-2"))
    decode.on_handover(sent[0])
    (error,) = d_out.of(RequestError)
    assert error.status == 503 and error.resumable and "version v2" in error.message
    assert not decode.has_work
    _settled(decode)


def test_a_dead_worker_voids_the_moves_in_flight() -> None:
    prefill, p_out, sent, decode, d_out = _pair()
    prefill.add(_request("r", max_tokens=5, prompt=PROMPT))
    _run(prefill, p_out)
    decode.on_handover(sent[0])
    decode.step()
    decode.on_worker_down("the worker process restarted")
    (error,) = d_out.of(RequestError)
    assert error.resumable
    decode.on_worker_ready(_info(boot_id="boot-2"))
    _settled(decode)


def test_an_abort_older_than_the_request_does_not_drop_its_hand_over() -> None:
    import dataclasses
    import time

    prefill, p_out, sent, decode, d_out = _pair()
    prefill.add(_request("r", max_tokens=3, prompt=PROMPT))
    _run(prefill, p_out)
    decode.abort(["r"], FinishReason.CANCELLED)  # an earlier request that used the id
    decode.on_handover(dataclasses.replace(sent[0], arrival_time=time.time() + 60))
    _run(decode, d_out)
    assert _tokens(d_out)[("r", 0)] == [7, 7]
    _settled(decode)


def test_a_long_import_is_spread_over_plans_and_queued_when_it_has_all_landed(
    monkeypatch,
) -> None:
    monkeypatch.setattr(handover, "IMPORT_BLOCKS_PER_STEP", 2)
    prefill, p_out, sent, decode, d_out = _pair()
    prompt = list(range(10, 31))  # 21 tokens: 5 full blocks of 4 and a tail
    prefill.add(_request("r", max_tokens=4, prompt=prompt))
    _run(prefill, p_out)
    (msg,) = sent
    assert len(msg.block_keys) == 6
    decode.on_handover(msg)
    _run(decode, d_out)
    plans = d_out.of(StepPlan)
    imports = [p.kv_import_keys for p in plans if p.kv_import_dst]
    assert imports == [msg.block_keys[0:2], msg.block_keys[2:4], msg.block_keys[4:6]]
    (new,) = [p for p in plans if p.new_req_ids]
    assert new.step_id > max(p.step_id for p in plans if p.kv_import_dst)
    assert new.num_computed_tokens == [21]  # every imported block is its prefix
    assert decode.handover is not None and decode.handover.stats.blocks_received == 6
    _settled(decode)


def test_a_cancel_between_the_plans_of_one_import_frees_everything(monkeypatch) -> None:
    monkeypatch.setattr(handover, "IMPORT_BLOCKS_PER_STEP", 2)
    prefill, p_out, sent, decode, d_out = _pair()
    prefill.add(_request("r", max_tokens=4, prompt=list(range(10, 31))))
    _run(prefill, p_out)
    decode.on_handover(sent[0])
    _step_once(decode, d_out)  # the first 2 blocks land, 3 wait
    assert decode.handover is not None and decode.handover.holds("r")
    decode.abort(["r"], FinishReason.CANCELLED)
    _run(decode, d_out)
    assert not [p for p in d_out.of(StepPlan) if p.new_req_ids]
    assert d_out.of(TokenBatch)[-1].finish_reasons == [int(FinishReason.CANCELLED)]
    _settled(decode)


def test_a_hand_over_leaves_when_its_exports_are_written_not_with_the_result() -> None:
    """The worker reports a plan's exports before its step runs (KvExported): the hand-over
    leaves then, and the step's result, which no longer carries them, sends nothing more."""
    prefill, p_out, sent, _, _ = _pair()
    prefill.add(_request("r", max_tokens=5, prompt=PROMPT))
    for _ in range(10):
        prefill.step()
        (plan,) = [
            p
            for p in p_out.of(StepPlan)
            if p.step_id in {s.step_id for s in prefill.window.in_flight}
        ]
        if plan.kv_export_src:
            break
        prefill.on_step_result(p_out.answer(plan))
    else:
        raise AssertionError("no plan exported")
    assert not sent
    prefill.on_kv_exported(KvExported(plan.step_id, [f"b{k}" for k in plan.kv_export_keys]))
    (msg,) = sent
    assert msg.block_data == [f"b{k}" for k in plan.kv_export_keys]
    result = p_out.answer(plan)
    prefill.on_step_result(StepResult(result.step_id, result.req_ids, result.token_ids))
    assert len(sent) == 1
    _run(prefill, p_out)
    _settled(prefill)


def _adapter_request(rid: str, lora_name: str) -> TokenizedRequest:
    return dataclasses.replace(_request(rid, max_tokens=5, prompt=PROMPT), lora_name=lora_name)


def test_an_adapters_sequence_is_decoded_with_the_same_adapter() -> None:
    prefill, p_out, sent, decode, d_out = _pair(({"a0": "h1"}, {"a0": "h1"}))
    prefill.add(_adapter_request("r", "a0"))
    _run(prefill, p_out)
    (msg,) = sent
    assert (msg.lora_name, msg.lora_hash) == ("a0", "h1")
    assert prefill.served is not None  # the blocks are keyed on the adapter's root
    assert msg.cache_root == lora_root(prefill.served.root, "a0", "h1") != prefill.served.root
    decode.on_handover(msg)
    _run(decode, d_out)
    (new,) = [p for p in d_out.of(StepPlan) if p.new_req_ids]
    assert new.new_loras == ["a0"] and new.num_computed_tokens == [10]
    assert _tokens(d_out)[("r", 0)] == [7] * 4
    assert (
        decode.loras.stats(Counter(), _blocks(decode).num_hashed_by_owner())["a0"][
            "num_cached_blocks"
        ]
        >= 2
    )  # (the imported blocks are the adapter's: an unload drops them)
    _settled(decode)


@pytest.mark.parametrize(
    ("held", "why"),
    [
        ({}, "does not serve the LoRA adapter `a0`"),
        ({"a0": "h2"}, "serves the LoRA adapter `a0` with other weights (h2)"),
    ],
)
def test_an_adapters_kv_is_refused_where_that_adapter_is_not_served_so(
    held: dict[str, str], why: str
) -> None:
    prefill, p_out, sent, decode, d_out = _pair(({"a0": "h1"}, held))
    prefill.add(_adapter_request("r", "a0"))
    _run(prefill, p_out)
    decode.on_handover(sent[0])
    (error,) = d_out.of(RequestError)
    assert error.status == 503 and error.resumable and why in error.message
    assert not [p for p in d_out.of(StepPlan) if p.kv_import_dst]  # its KV is never taken
    assert not decode.has_work
    _settled(decode)


def test_a_hand_over_of_the_next_version_waits_for_the_decode_replicas_swap() -> None:
    """Both replicas drain-swap to v2; the prefill replica is done first and hands over a
    v2 sequence while the decode replica still drains (a v1 sequence of its own decoding):
    the hand-over waits for the swap instead of failing, then lands on v2. The decode
    replica's drain also waits for its own imports before its pool is rebuilt."""
    prefill, p_out, sent, decode, d_out = _pair()
    decode.add(_request("old", max_tokens=6, prompt=PROMPT))
    decode.step()
    for core in (prefill, decode):
        core.swap(SwapModel(ticket=1, reply_to="gw", path="/models/v2", version="v2",
                            mode="drain"))  # fmt: skip
    _run(prefill, p_out)
    prefill.on_model_loaded(ModelLoaded(version="v2", model=_info("v2")))
    prefill.add(_request("new", max_tokens=5, prompt=PROMPT))
    _run(prefill, p_out)
    (msg,) = sent
    assert msg.version == "v2"
    decode.on_handover(msg)  # decode is still draining "old" on v1
    assert not d_out.of(RequestError) and decode._parked == [msg]
    _run(decode, d_out)  # "old" finishes; the drain loads v2
    decode.step()
    assert d_out.of(LoadModel)[-1].version == "v2"
    decode.on_model_loaded(ModelLoaded(version="v2", model=_info("v2")))
    _run(decode, d_out)
    assert not d_out.of(RequestError) and not decode._parked
    tokens = _tokens(d_out)
    assert tokens[("old", 0)] == [7] * 6 and tokens[("new", 0)] == [7] * 4
    _settled(decode)
