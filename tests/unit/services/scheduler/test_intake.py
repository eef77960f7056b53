"""Request intake (services/scheduler/intake.py) through EngineCore: a request's sequences and
their keys, and the admission errors that name the field."""

from __future__ import annotations

from common.messages import DetokNew, RequestError
from services.scheduler.intake import sequence_key
from tests.unit.services.scheduler.test_engine_core import TOKEN, _core, _request, _run, _tokens


def test_n_sequences_are_one_group_with_indices() -> None:
    core, out = _core()
    core.add(_request("req#1", n=3))  # a '#' in a client id means nothing
    (new,) = out.of(DetokNew)
    assert new.request_ids == ["req#1"] * 3 and new.seq_indices == [0, 1, 2]
    assert new.tokenizers == ["tok-a"] * 3
    assert sorted(core.policy.requests) == sorted(sequence_key("req#1", i) for i in range(3))
    _run(core, out)
    assert _tokens(out) == {("req#1", i): [TOKEN] * 3 for i in range(3)}
    assert not core.groups and not core.policy.requests
    core.policy.check_idle()


def test_admission_errors_name_the_field() -> None:
    core, out = _core()
    core.add(_request("long", prompt=list(range(3, 131))))
    core.add(_request("vocab", prompt=[5, 6, 100]))
    core.add(_request("ok"))
    core.add(_request("ok"))
    errors = {e.request_id: e for e in out.of(RequestError)}
    assert errors["long"].status == 400 and errors["long"].param == "prompt"
    assert errors["long"].message.startswith("prompt: the prompt has 128 tokens")
    assert errors["vocab"].status == 400 and errors["vocab"].param == "prompt"
    assert "token id 100" in errors["vocab"].message
    assert errors["ok"].param == "X-Request-Id"
    assert list(core.groups) == ["ok"]
