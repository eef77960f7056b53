"""The scheduler holds a request until its grammar is compiled (services/scheduler/
grammar_wait.py, driven through a real EngineCore): then runs it, or fails it naming the
field, and lets an abort, a deadline or a worker restart end it while it waits."""

from __future__ import annotations

import dataclasses
from typing import Any

from common.messages import (
    CompileGrammar,
    FinishReason,
    GrammarCompiled,
    RequestError,
    StepPlan,
    TokenBatch,
)
from tests.unit.services.scheduler.test_engine_core import _core, _request, _run, _tokens


# --- the scheduler holds a request until its grammar is compiled --------------------------------
def _constrained(rid: str, n: int = 1) -> Any:
    msg = _request(rid, n=n)
    sampling = dataclasses.replace(
        msg.sampling, structured_kind="regex", structured_spec="a", structured_field="guided_regex"
    )
    return dataclasses.replace(msg, sampling=sampling)


def test_a_request_waits_for_its_grammar_then_runs() -> None:
    core, out = _core()
    core.add(_constrained("g", n=2))
    core.add(_request("free"))
    (ask,) = out.of(CompileGrammar)
    assert (ask.request_id, ask.kind, ask.spec, ask.tokenizer_fingerprint) == (
        "g", "regex", "a", "tok-a"
    )  # fmt: skip
    _run(core, out)
    assert not any("g" in p.req_ids[i] for p in out.of(StepPlan) for i in range(len(p.req_ids)))
    assert _tokens(out)[("free", 0)]  # the free request ran meanwhile
    core.on_grammar_compiled(GrammarCompiled(request_id="g", tokenizer_fingerprint="tok-a"))
    _run(core, out)
    got = _tokens(out)
    assert len(got[("g", 0)]) == 3 and len(got[("g", 1)]) == 3
    assert not core.groups and core.policy is not None and not core.policy.requests


def test_a_grammar_that_does_not_compile_is_a_400_naming_its_field() -> None:
    core, out = _core()
    core.add(_constrained("g"))
    failed = GrammarCompiled("g", "Unsupported regex", tokenizer_fingerprint="tok-a")
    core.on_grammar_compiled(failed)
    (error,) = out.of(RequestError)
    assert (error.status, error.param) == (400, "guided_regex")
    assert error.message == "guided_regex: Unsupported regex"
    assert not core.groups and not len(core.grammar_wait)
    assert core.policy is not None and core.policy.blocks.num_used_blocks == 0


def test_a_request_aborted_while_its_grammar_compiles_ends_there() -> None:
    core, out = _core()
    core.add(_constrained("g", n=2))
    core.abort(["g"], FinishReason.CANCELLED)
    (batch,) = out.of(TokenBatch)
    assert batch.finish_reasons == [int(FinishReason.CANCELLED)] * 2
    assert not core.groups and not len(core.grammar_wait)
    # late: nothing to queue
    core.on_grammar_compiled(GrammarCompiled(request_id="g", tokenizer_fingerprint="tok-a"))
    assert core.policy is not None and not core.policy.requests


def test_a_worker_restart_fails_requests_waiting_for_a_grammar() -> None:
    core, out = _core()
    core.add(_constrained("g"))
    core.on_worker_down("the worker died")
    (error,) = out.of(RequestError)
    assert error.status == 503 and not core.groups and not len(core.grammar_wait)


def test_a_request_past_its_deadline_while_its_grammar_compiles_times_out() -> None:
    core, out = _core()
    core.add(dataclasses.replace(_constrained("late", n=2), timeout=1.0, arrival_time=1.0))
    core.add(_constrained("on-time"))
    core.expire()  # the clock is far past 1.0 + 1.0
    (batch,) = out.of(TokenBatch)
    assert batch.request_ids == ["late", "late"]
    assert batch.finish_reasons == [int(FinishReason.TIMEOUT)] * 2
    assert "late" not in core.groups and "on-time" in core.grammar_wait


def test_an_answer_for_another_tokenizer_does_not_release_a_request() -> None:
    # tokenised again for a new tokenizer (a swap) while the old compile was running
    core, out = _core()
    core.add(_constrained("g"))
    core.on_grammar_compiled(GrammarCompiled(request_id="g", tokenizer_fingerprint="tok-old"))
    assert "g" in core.grammar_wait
    core.on_grammar_compiled(GrammarCompiled(request_id="g", tokenizer_fingerprint="tok-a"))
    assert "g" not in core.grammar_wait
    _run(core, out)
    assert len(_tokens(out)[("g", 0)]) == 3
