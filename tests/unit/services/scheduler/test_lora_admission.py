"""--max-loras admission, driven through the real policy: at most max_loras distinct adapters
per step (running ones count, the base model does not), FCFS with the adapter constraint,
and no adapter starves behind a stream of requests of the adapters that run."""

from __future__ import annotations

from common.messages import SamplingParams
from services.scheduler.block_manager import BlockManager
from services.scheduler.lora_admission import MAX_SKIPS
from services.scheduler.policy import PolicyConfig, SchedulingPolicy
from services.scheduler.request import Request


def _req(rid: str, lora: str, max_tokens: int = 4) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    base = 1000 * (sum(map(ord, rid)) % 97)
    return Request(rid, list(range(base, base + 5)), params, lora_name=lora, lora_hash="h")


def _sched(max_loras: int, seqs: int = 16) -> SchedulingPolicy:
    cfg = PolicyConfig(
        max_num_seqs=seqs, max_num_batched_tokens=256, watermark=0.0, max_loras=max_loras
    )
    return SchedulingPolicy(BlockManager(256, 4), cfg)


def _step(s: SchedulingPolicy) -> list[str]:
    """Plan a step, feed one token to each request that samples; the ids scheduled."""
    out = s.schedule()
    sampled = [x.request.request_id for x in out.scheduled if x.samples]
    s.update(sampled, [7] * len(sampled))
    return [x.request.request_id for x in out.scheduled]


def _adapters(s: SchedulingPolicy) -> set[str]:
    return {r.lora_name for r in s.running if r.lora_name}


def test_at_most_max_loras_adapters_run_and_the_base_model_is_free() -> None:
    s = _sched(max_loras=2)
    for rid, lora in [("a1", "A"), ("b1", "B"), ("c1", "C"), ("base", ""), ("a2", "A")]:
        s.add(_req(rid, lora))
    assert _step(s) == ["a1", "b1", "base", "a2"]  # c1 waits for a slot; others pass it
    assert _adapters(s) == {"A", "B"}
    plan = s.schedule()
    assert plan.new_requests == []  # (no new request: c1 still waits)


def test_a_waiting_new_adapter_blocks_younger_new_adapters() -> None:
    s = _sched(max_loras=1)
    for rid, lora, max_tokens in [("a1", "A", 8), ("b1", "B", 4), ("c1", "C", 1)]:
        s.add(_req(rid, lora, max_tokens))
    s.add(_req("c2", "C", 1))
    assert _step(s) == ["a1"]
    while "a1" in s.requests:
        assert _adapters(s) <= {"A"} and "c1" not in {r.request_id for r in s.running}
        _step(s)
    assert _step(s) == ["b1"]  # b1 came first: C never takes the slot b1 waits for


def test_plans_name_each_new_requests_adapter() -> None:
    from services.scheduler.plan import to_plan

    s = _sched(max_loras=2)
    s.add(_req("a", "A"))
    s.add(_req("base", ""))
    plan = to_plan(1, s.schedule())
    assert plan.new_loras == ["A", ""]
    s2 = _sched(max_loras=2)
    s2.add(_req("base", ""))
    assert to_plan(1, s2.schedule()).new_loras == []  # no adapter: the field stays empty


def test_no_starvation_under_a_stream_of_running_adapters_requests() -> None:
    s = _sched(max_loras=1, seqs=64)
    s.add(_req("a0", "A", max_tokens=3))
    _step(s)
    s.add(_req("b", "B"))
    i, started_at = 0, None
    for step in range(10 * MAX_SKIPS):  # A's requests keep coming, each younger than b
        i += 1
        s.add(_req(f"a{i}", "A", max_tokens=3))
        if "b" in _step(s):
            started_at = step
            break
    assert started_at is not None and started_at <= MAX_SKIPS + 8
    assert _adapters(s) == {"B"}


def test_without_lora_nothing_changes() -> None:
    s = _sched(max_loras=0)
    for rid in ("a", "b", "c"):
        s.add(_req(rid, rid.upper()))
    assert _step(s) == ["a", "b", "c"]
