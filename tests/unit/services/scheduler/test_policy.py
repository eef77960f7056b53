"""The scheduling policy, driven with no processes and no model: what it plans, and its
invariants through random add / step / finish / abort sequences (with preemption)."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from common.messages import FinishReason, SamplingParams
from services.scheduler.block_manager import BlockManager
from services.scheduler.policy import PolicyConfig, SchedulingPolicy
from services.scheduler.request import Request, Status


def _req(rid: str, prompt_len: int, max_tokens: int = 4, eos: tuple[int, ...] = ()) -> Request:
    base = 1000 * (sum(map(ord, rid)) % 97)  # distinct prompts: no accidental prefix hits
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return Request(rid, list(range(base + 1, base + prompt_len + 1)), params, eos_token_ids=eos)


def _sched(
    num_blocks: int = 64, block_size: int = 4, seqs: int = 8, budget: int = 32, **kw: object
) -> SchedulingPolicy:
    cfg = PolicyConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, watermark=0.0, **kw)
    return SchedulingPolicy(BlockManager(num_blocks, block_size), cfg)


def _run_step(s: SchedulingPolicy, token: int = 7) -> dict[str, int]:
    """Plan a step and feed back one token for each request that reached its end."""
    out = s.schedule()
    sampled = [x.request.request_id for x in out.scheduled if x.samples]
    s.update(sampled, [token] * len(sampled))
    return {x.request.request_id: x.num_new_tokens for x in out.scheduled}


def test_prompt_is_chunked_by_the_token_budget() -> None:
    s = _sched(budget=10)
    s.add(_req("a", 25))
    assert [_run_step(s) for _ in range(3)] == [{"a": 10}, {"a": 10}, {"a": 5}]
    assert s.requests["a"].output_token_ids == [7]
    assert _run_step(s) == {"a": 1}  # decode


def test_decodes_go_first_then_prefill_chunks_then_admissions() -> None:
    s = _sched(budget=8)
    s.add(_req("a", 3))
    _run_step(s)  # a prefilled, sampled
    s.add(_req("b", 20))
    s.add(_req("c", 2))
    plan = _run_step(s)
    assert list(plan) == ["a", "b"] and plan == {"a": 1, "b": 7}
    plan = _run_step(s)
    assert list(plan) == ["a", "b"] and plan == {"a": 1, "b": 7}


def test_sequence_cap_limits_running_requests() -> None:
    s = _sched(seqs=2)
    for i in range(4):
        s.add(_req(f"r{i}", 3))
    assert set(_run_step(s)) == {"r0", "r1"}
    assert s.num_running == 2 and s.num_waiting == 2


def test_finish_by_length_frees_blocks_in_the_same_step() -> None:
    s = _sched()
    s.add(_req("a", 5, max_tokens=2))
    _run_step(s)
    _run_step(s)
    assert "a" not in s.requests
    assert s.blocks.num_free_blocks == s.blocks.num_blocks
    out = s.schedule()
    assert out.finished_req_ids == ["a"] and not out.scheduled


def test_eos_finishes_unless_ignored() -> None:
    s = _sched()
    s.add(_req("a", 3, max_tokens=10, eos=(7,)))
    s.add(Request("b", [1, 2], SamplingParams(max_tokens=10, ignore_eos=True), eos_token_ids=(7,)))
    _run_step(s, token=7)
    assert "a" not in s.requests and "b" in s.requests


def test_abort_is_idempotent_and_frees_waiting_and_running() -> None:
    s = _sched(seqs=1)
    s.add(_req("a", 3))
    s.add(_req("b", 3))
    _run_step(s)
    assert s.abort("a", FinishReason.CANCELLED) is not None
    assert s.abort("a", FinishReason.CANCELLED) is None
    assert s.abort("b", FinishReason.CANCELLED) is not None
    assert not s.requests and s.blocks.num_free_blocks == s.blocks.num_blocks
    s.check_integrity()


def test_preemption_recomputes_the_newest_and_keeps_its_tokens() -> None:
    s = _sched(num_blocks=4, block_size=4, budget=64)
    s.add(_req("a", 8, max_tokens=8))
    s.add(_req("b", 8, max_tokens=8))
    _run_step(s)  # a: 2 blocks, b: 2 blocks; both sampled their 9th token
    out = s.schedule()  # a needs a 3rd block at token 9: b is preempted
    assert out.preempted_req_ids == ["b"]
    assert [x.request.request_id for x in out.scheduled] == ["a"]
    b = s.requests["b"]
    assert b.status == Status.WAITING and b.num_computed_tokens == 0
    assert b.output_token_ids == [7] and s.num_preemptions == 1
    s.check_integrity()


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 10**6), st.integers(6, 40), st.integers(1, 24))
def test_random_workload_keeps_invariants_and_finishes_everything(
    seed: int, num_blocks: int, budget: int
) -> None:
    rng = random.Random(seed)
    s = _sched(num_blocks=num_blocks, block_size=4, seqs=rng.randint(1, 6), budget=budget)
    max_len = num_blocks * 4
    ids = iter(range(10**6))
    produced: dict[str, list[int]] = {}
    for _ in range(400):
        r = rng.random()
        if r < 0.15:
            plen = rng.randint(1, max(1, max_len // 3))
            req = Request(
                f"r{next(ids)}",
                [1] * plen,
                SamplingParams(max_tokens=rng.randint(1, 8)),
                eos_token_ids=(0,),
                max_model_len=max_len,
            )
            s.add(req)
            produced[req.request_id] = []
        elif r < 0.2 and s.requests:
            s.abort(rng.choice(sorted(s.requests)), FinishReason.CANCELLED)
        else:
            out = s.schedule()
            for x in out.scheduled:
                assert x.num_new_tokens >= 1
                assert len(s.blocks.block_tables[x.request.request_id]) * 4 >= (
                    x.num_computed_tokens + x.num_new_tokens
                )
            assert out.num_tokens <= budget
            sampled = [x.request.request_id for x in out.scheduled if x.samples]
            toks = [rng.choice([0, 5, 6]) for _ in sampled]
            for rid, t in zip(sampled, toks, strict=True):
                produced[rid].append(t)
            s.update(sampled, toks)
        s.check_integrity()
    while s.has_work():  # drain: everything admitted must finish
        s.schedule() if not s.requests else _run_step(s, token=5)
        s.check_integrity()
    assert s.blocks.num_free_blocks == num_blocks
