"""Static and dynamic batching (services/scheduler/batching.py) as the real scheduler applies
them, on a clock the test moves: who is admitted, when, and that a batch runs to completion
before the next one opens. Continuous batching, beside them, admits at once."""

from __future__ import annotations

from common.messages import SamplingParams
from services.scheduler.block_manager import BlockManager
from services.scheduler.policy import PolicyConfig, SchedulingPolicy
from services.scheduler.request import Request


class Clock:
    """The scheduler's clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _sched(policy: str, clock: Clock, seqs: int = 3) -> SchedulingPolicy:
    config = PolicyConfig(
        max_num_seqs=seqs,
        max_num_batched_tokens=64,
        watermark=0.0,
        batch_policy=policy,
        batch_window=0.2,
        static_batch_timeout=1.0,
    )
    return SchedulingPolicy(BlockManager(64, 4), config, clock=clock)


def _add(s: SchedulingPolicy, rid: str, max_tokens: int = 2) -> None:
    base = 100 * (sum(map(ord, rid)) % 50)  # distinct prompts: no prefix-cache hits
    prompt = list(range(base + 1, base + 5))
    s.add(Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0)))


def _step(s: SchedulingPolicy) -> list[str]:
    """One step; every request that samples gets a token. Returns the newly admitted ids."""
    running_before = {r.request_id for r in s.running}
    out = s.schedule()
    sampled = [x.request.request_id for x in out.scheduled if x.samples]
    s.update(sampled, [7] * len(sampled))
    return sorted(
        x.request.request_id for x in out.scheduled if x.request.request_id not in running_before
    )


def _run_until_idle(s: SchedulingPolicy) -> None:
    while s.running:
        _step(s)


def test_continuous_batching_admits_at_once_even_while_others_run() -> None:
    clock = Clock()
    s = _sched("continuous", clock)
    _add(s, "a", max_tokens=5)
    assert _step(s) == ["a"]
    _add(s, "b")
    assert _step(s) == ["b"]  # joins the running batch


def test_static_batching_waits_for_a_full_batch() -> None:
    clock = Clock()
    s = _sched("static", clock, seqs=3)
    _add(s, "a")
    _add(s, "b")
    assert _step(s) == [] and s.num_waiting == 2  # two of three, and no timeout yet
    _add(s, "c")
    assert _step(s) == ["a", "b", "c"]  # full: the batch starts


def test_static_batching_runs_a_batch_to_completion_before_the_next() -> None:
    clock = Clock()
    s = _sched("static", clock, seqs=2)
    _add(s, "a", max_tokens=4)
    _add(s, "b", max_tokens=4)
    assert _step(s) == ["a", "b"]
    _add(s, "c")
    _add(s, "d")  # a full batch waits...
    for _ in range(2):
        assert _step(s) == []  # ...while the current one runs
    _run_until_idle(s)
    assert _step(s) == ["c", "d"]


def test_static_batching_starts_a_partial_batch_after_its_timeout() -> None:
    clock = Clock()
    s = _sched("static", clock, seqs=3)
    _add(s, "a")
    clock.now = 0.5
    assert _step(s) == []
    clock.now = 1.0  # the oldest has waited static_batch_timeout
    assert _step(s) == ["a"]
    _add(s, "b")  # arrives while the batch of one runs: waits for it, then its own timeout
    assert _step(s) == []
    _run_until_idle(s)
    assert _step(s) == []
    clock.now = 2.0
    assert _step(s) == ["b"]


def test_dynamic_batching_collects_for_a_window_from_the_first_arrival() -> None:
    clock = Clock()
    s = _sched("dynamic", clock, seqs=4)
    _add(s, "a")
    clock.now = 0.1
    assert _step(s) == []
    _add(s, "b")
    clock.now = 0.15
    assert _step(s) == []
    clock.now = 0.2  # batch_window after a's arrival: a and b go together
    assert _step(s) == ["a", "b"]


def test_dynamic_batching_opens_early_on_a_full_batch() -> None:
    clock = Clock()
    s = _sched("dynamic", clock, seqs=2)
    _add(s, "a")
    _add(s, "b")
    assert _step(s) == ["a", "b"]  # max_num_seqs reached before the window ends


def test_dynamic_batching_admits_no_more_than_a_batch() -> None:
    clock = Clock()
    s = _sched("dynamic", clock, seqs=2)
    for rid in ("a", "b", "c"):
        _add(s, rid)
    assert _step(s) == ["a", "b"]
    assert s.num_waiting == 1
    _run_until_idle(s)
    clock.now = 0.2  # c has waited a window already: it goes at once
    assert _step(s) == ["c"]
