"""EngineCore with resumed requests (TokenizedRequest.resumed_token_ids), no processes and no
model: a request sent again after a process died starts with the outputs it already
produced, recomputes them after its prompt like a preemption by recompute, and produces only
what max_tokens leaves; the worker and the detokenizer hear of those outputs. Requests lost
to a worker's death are failed as resumable."""

from __future__ import annotations

import dataclasses

from common.messages import DetokNew, RequestError, SamplingParams, StepPlan
from services.scheduler.intake import sequence_key
from tests.unit.services.scheduler.test_engine_core import (
    TOKEN,
    _core,
    _info,
    _request,
    _run,
    _tokens,
)

PROMPT = [10, 11, 12, 13, 14]


def test_a_resumed_request_recomputes_its_outputs_and_produces_the_rest() -> None:
    core, out = _core()
    core.add(dataclasses.replace(_request("r", max_tokens=5), resumed_token_ids=[20, 21]))
    (new,) = out.of(DetokNew)
    assert new.resumed_token_ids == [[20, 21]] and new.num_prompt_tokens == [len(PROMPT)]
    _run(core, out)
    first = out.of(StepPlan)[0]
    assert first.new_req_ids == [sequence_key("r", 0)]
    assert first.new_prompt_token_ids == [[*PROMPT, 20, 21]]
    assert first.new_num_output_tokens == [2]
    assert sum(first.num_new_tokens) == len(PROMPT) + 2  # prompt and outputs, recomputed
    assert _tokens(out) == {("r", 0): [TOKEN] * 3}  # 5 - 2 more
    core.policy.check_idle()


def test_plain_requests_put_no_output_counts_on_the_wire() -> None:
    core, out = _core()
    core.add(_request("plain"))
    core.step()
    assert out.of(StepPlan)[0].new_num_output_tokens == []
    assert out.of(DetokNew)[0].resumed_token_ids == []


def test_one_that_cannot_be_resumed_here_is_refused_for_good() -> None:
    core, out = _core()
    core.add(dataclasses.replace(_request("n2", n=2), resumed_token_ids=[20]))
    done = dataclasses.replace(_request("done", max_tokens=2), resumed_token_ids=[20, 21])
    core.add(done)  # nothing left to produce
    errors = out.of(RequestError)
    assert [(e.request_id, e.status, e.resumable) for e in errors] == [
        ("n2", 503, False),
        ("done", 503, False),
    ]
    assert not core.groups


def test_requests_lost_with_the_worker_are_resumable() -> None:
    core, out = _core()
    core.add(_request("a", max_tokens=50))
    core.step()
    core.on_worker_down("the worker process restarted")
    core.add(_request("b"))  # while it restarts
    errors = out.of(RequestError)
    assert [(e.request_id, e.status, e.resumable) for e in errors] == [
        ("a", 503, True),
        ("b", 503, True),
    ]
    core.on_worker_ready(_info(boot_id="boot-2"))
    sampling = SamplingParams(max_tokens=3, temperature=0.0)
    core.add(dataclasses.replace(_request("a/resume-1"), sampling=sampling, resumed_token_ids=[7]))
    _run(core, out)
    assert _tokens(out)[("a/resume-1", 0)] == [TOKEN] * 2
