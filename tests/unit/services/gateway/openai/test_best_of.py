"""best_of (services/gateway/openai/best_of.py): the engine samples best_of sequences, asking for
their logprobs; the answer keeps the n with the highest cumulative logprob, numbered again,
through the real HTTP app over a scripted engine."""

from __future__ import annotations

from common.messages import FinishReason
from services.gateway.engine.client import OutputDelta
from services.gateway.openai.logprobs import TokenLogprob
from tests.fake_engine import FakeEngine
from tests.unit.services.gateway.http.test_app import COMPLETIONS, run


def _seq(index: int, text: str, logprobs: list[float], last: bool) -> OutputDelta:
    entries = [TokenLogprob(7, "x", lp, []) for lp in logprobs]
    return OutputDelta(
        text, [7] * len(logprobs), FinishReason.STOP, 4, len(logprobs), last=last,
        index=index, logprobs=entries,
    )  # fmt: skip


SCRIPT = [
    _seq(0, "low", [-3.0, -2.0], False),  # -5
    _seq(1, "best", [-0.5, -0.5, -0.5], False),  # -1.5
    _seq(2, "good", [-1.0, -1.0], True),  # -2
]


def test_the_n_best_of_best_of_by_cumulative_logprob() -> None:
    engine = FakeEngine(SCRIPT)
    out = run(engine, "POST", COMPLETIONS, json={"prompt": "p", "n": 2, "best_of": 3}).json()
    assert [(c["index"], c["text"]) for c in out["choices"]] == [(0, "best"), (1, "good")]
    assert all(c["logprobs"] is None for c in out["choices"])  # (not asked: not shown)
    assert out["usage"]["completion_tokens"] == 7  # every sequence sampled
    sent = engine.requests[-1].sampling
    assert sent.n == 3 and sent.logprobs == 0
    out = run(FakeEngine(SCRIPT), "POST", COMPLETIONS, json={"prompt": "p", "best_of": 3,
                                                              "logprobs": 1}).json()  # fmt: skip
    (best,) = out["choices"]
    assert best["index"] == 0 and best["text"] == "best"
    assert best["logprobs"]["token_logprobs"] == [-0.5, -0.5, -0.5]


def test_best_of_equal_to_n_asks_nothing_more() -> None:
    engine = FakeEngine()
    assert run(engine, "POST", COMPLETIONS, json={"prompt": "p", "n": 2, "best_of": 2}).is_success
    assert engine.requests[-1].sampling.n == 2 and engine.requests[-1].sampling.logprobs is None
