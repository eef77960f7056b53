"""What the detokenizer hears from EngineCore (services/scheduler/detok_messages.py): a new
request's sequences with their stop settings, and each step's tokens with their logprobs."""

from __future__ import annotations

import dataclasses
from typing import Any

from common.config import Config
from common.messages import DetokNew, SamplingParams, StepPlan, StepResult, TokenBatch
from services.scheduler.engine_core import EngineCore
from services.scheduler.intake import sequence_key
from tests.unit.services.scheduler.test_engine_core import (
    TOKEN,
    Outbox,
    _core,
    _info,
    _request,
    _run,
)


def test_the_detokenizer_hears_min_tokens_for_its_stop_strings() -> None:
    core, out = _core()
    core.add(_request("plain"))
    sampling = SamplingParams(max_tokens=5, min_tokens=3, stop=["x"], n=2)
    core.add(dataclasses.replace(_request("held"), sampling=sampling))
    plain, held = out.of(DetokNew)
    assert plain.min_tokens == []  # (none asked: the field stays empty)
    assert held.min_tokens == [3, 3] and held.stop == [["x"], ["x"]]


class LogprobWorker(Outbox):
    """A worker that also reports logprobs, as the model runner lays them out: per sampled
    token [token, 5] with [-0.5, -0.1] for requests that ask; the prompt's entries with the
    first token."""

    def __init__(self) -> None:
        super().__init__()
        self.asks: dict[str, SamplingParams] = {}

    def answer(self, plan: StepPlan) -> StepResult:
        for rid, params in zip(plan.new_req_ids, plan.new_sampling, strict=True):
            self.asks[rid] = params
        prompts = dict(zip(plan.new_req_ids, plan.new_prompt_token_ids, strict=True))
        first = set(plan.new_req_ids)
        result = super().answer(plan)
        asking = [self.asks[r].logprobs is not None for r in result.req_ids]
        prompt = [
            [[p[0]], *[[t, 5] for t in p[1:]]]
            if r in first and self.asks[r].prompt_logprobs
            else []
            for r in result.req_ids
            for p in [prompts.get(r, [])]
        ]
        return dataclasses.replace(
            result,
            logprob_token_ids=[[TOKEN, 5] if a else [] for a in asking] if any(asking) else [],
            logprob_values=[[-0.5, -0.1] if a else [] for a in asking] if any(asking) else [],
            prompt_logprob_token_ids=prompt if any(prompt) else [],
            prompt_logprob_values=[
                [[], *[[-1.0, -0.2] for _ in e[1:]]] if e else [] for e in prompt
            ]
            if any(prompt)
            else [],
        )


def test_logprobs_pass_through_to_the_detokenizer() -> None:
    out = LogprobWorker()
    config = Config().replace(scheduler={"async_scheduling": False})
    core = EngineCore(config, out)
    core.on_worker_ready(_info())
    core.add(_request("plain", prompt=[10, 11, 12, 13, 14, 15]))  # caches the first block
    _run(core, out)
    asking = _request("asks", prompt=[10, 11, 12, 13, 14, 15])
    params = dataclasses.replace(asking.sampling, logprobs=1, prompt_logprobs=1)
    core.add(dataclasses.replace(asking, sampling=params))
    core.add(_request("other"))
    _run(core, out)
    key = sequence_key("asks", 0)
    first_plan = next(p for p in out.of(StepPlan) if key in p.new_req_ids)
    # prompt logprobs need every prompt position computed: no prefix hit
    assert first_plan.num_computed_tokens[first_plan.req_ids.index(key)] == 0
    got: dict[str, list[Any]] = {}
    prompts: dict[str, list[Any]] = {}
    for batch in out.of(TokenBatch):
        for i, rid in enumerate(batch.request_ids):
            if batch.logprob_token_ids:
                got.setdefault(rid, []).extend(
                    zip(batch.logprob_token_ids[i], batch.logprob_values[i], strict=True)
                )
            if batch.prompt_logprob_token_ids and batch.prompt_logprob_token_ids[i]:
                prompts.setdefault(rid, []).append(
                    (batch.prompt_logprob_token_ids[i], batch.prompt_logprob_values[i])
                )
    assert got["asks"] == [([TOKEN, 5], [-0.5, -0.1])] * 3
    # "other" shares the steps of "asks": its rows are there, and empty (it did not ask)
    assert got["other"] and all(entry == ([], []) for entry in got["other"])
    assert "plain" not in got
    assert prompts == {
        "asks": [
            (
                [[10], *[[t, 5] for t in (11, 12, 13, 14, 15)]],
                [[], *[[-1.0, -0.2]] * 5],
            )
        ]
    }
