"""EngineCore with embeddings requests (SamplingParams.pooling), no processes and no model:
a pooled request's prompt runs in chunks like any prefill, the step that ends it answers its
vector, and the request finishes there (STOP, no token) with its blocks freed; mean pooling
takes no prefix-cache hits, last-token pooling does; an embeddings prompt may fill the
model's length."""

from __future__ import annotations

import dataclasses

from common.config import Config
from common.messages import (
    FinishReason,
    RequestError,
    SamplingParams,
    StepPlan,
    StepResult,
    TokenBatch,
    TokenizedRequest,
)
from services.scheduler.engine_core import EngineCore
from services.scheduler.intake import sequence_key
from tests.unit.services.scheduler.test_engine_core import TOKEN, Outbox, _info, _run

PROMPT = list(range(10, 19))  # 9 tokens: two full blocks of 4 and one more


@dataclasses.dataclass
class PoolingWorker(Outbox):
    """The fake worker, pooling too: a request whose prompt is computed answers the vector
    [prompt length, 1.0] and samples nothing."""

    pooling: dict[str, str] = dataclasses.field(default_factory=dict)

    def answer(self, plan: StepPlan) -> StepResult:
        for rid, params in zip(plan.new_req_ids, plan.new_sampling, strict=True):
            self.pooling[rid] = params.pooling
        for rid, prompt in zip(plan.new_req_ids, plan.new_prompt_token_ids, strict=True):
            self.known[rid] = len(prompt)
        sampled, pooled = [], []
        batch = zip(plan.req_ids, plan.num_computed_tokens, plan.num_new_tokens, strict=True)
        for rid, done, new in batch:
            if done + new == self.known[rid]:
                if self.pooling[rid]:
                    pooled.append(rid)
                else:
                    sampled.append(rid)
                    self.known[rid] += 1
        return StepResult(
            step_id=plan.step_id,
            req_ids=sampled,
            token_ids=[TOKEN] * len(sampled),
            # every sampled token's logprobs, as for requests that asked
            logprob_token_ids=[[TOKEN]] * len(sampled),
            logprob_values=[[-0.5]] * len(sampled),
            prompt_logprob_token_ids=[[[1]]] * len(sampled),
            prompt_logprob_values=[[[]]] * len(sampled),
            pooled_req_ids=pooled,
            embeddings=[[float(self.known[rid]), 1.0] for rid in pooled],
        )


def _core(**scheduler: int) -> tuple[EngineCore, PoolingWorker]:
    out = PoolingWorker()
    core = EngineCore(Config().replace(scheduler={"async_scheduling": False, **scheduler}), out)
    core.on_worker_ready(_info())
    return core, out


def _request(rid: str, pooling: str = "", prompt: list[int] = PROMPT) -> TokenizedRequest:
    max_tokens = 1 if pooling else 3
    return TokenizedRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, pooling=pooling),
        eos_token_ids=[2],
        tokenizer_fingerprint="tok-a",
    )


def _finishes(out: PoolingWorker) -> dict[str, tuple[list[int], int, list[float]]]:
    """Each request's tokens, finish reason and vector, from every TokenBatch."""
    got: dict[str, tuple[list[int], int, list[float]]] = {}
    for batch in out.of(TokenBatch):
        for i, rid in enumerate(batch.request_ids):
            tokens, _, _ = got.get(rid, ([], 0, []))
            vector = batch.embeddings[i] if batch.embeddings else []
            got[rid] = (tokens + batch.token_ids[i], batch.finish_reasons[i], vector)
    return got


def _first_computed(out: PoolingWorker, rid: str) -> int:
    key = sequence_key(rid, 0)
    plan = next(p for p in out.of(StepPlan) if key in p.new_req_ids)
    return plan.num_computed_tokens[plan.req_ids.index(key)]


def test_pooled_requests_finish_with_their_vector_beside_generation() -> None:
    core, out = _core(max_num_batched_tokens=4)  # chunks of at most 4 tokens per step
    for rid, pooling in (("gen", ""), ("last", "last"), ("mean", "mean")):
        core.add(_request(rid, pooling))
    _run(core, out)
    got = _finishes(out)
    stop = int(FinishReason.STOP)
    assert got["last"] == ([], stop, [9.0, 1.0]) and got["mean"] == ([], stop, [9.0, 1.0])
    assert got["gen"][0] == [TOKEN] * 3
    # the vector comes once, with the finish; every batch lists [] for the others
    vectors = [b.embeddings for b in out.of(TokenBatch) if b.embeddings]
    assert sum(len([v for v in e if v]) for e in vectors) == 2
    # a step's logprobs (of the generating request) leave the pooled ones' entries empty
    mixed = [b for b in out.of(TokenBatch) if b.logprob_token_ids and b.embeddings]
    assert mixed  # (a step that sampled "gen" and finished a pooled request)
    for batch in mixed:
        for i, rid in enumerate(batch.request_ids):
            if rid != "gen":
                assert batch.logprob_token_ids[i] == [] and batch.prompt_logprob_token_ids[i] == []
    assert core.policy is not None and core.policy.blocks.num_used_blocks == 0


def test_mean_pooling_takes_no_prefix_hits_last_pooling_does() -> None:
    core, out = _core()
    core.add(_request("warm"))  # caches PROMPT's two full blocks
    _run(core, out)
    core.add(_request("mean", "mean"))
    core.add(_request("last", "last"))
    _run(core, out)
    assert _first_computed(out, "mean") == 0
    assert _first_computed(out, "last") == 8
    assert _finishes(out)["last"][2] == [9.0, 1.0]


def test_an_embeddings_prompt_may_fill_the_model_length() -> None:
    core, out = _core()
    full = [3 + i % 90 for i in range(128)]  # max_model_len 128, vocab_size 100
    core.add(_request("pooled", "mean", full))
    core.add(_request("generating", "", full))
    _run(core, out)
    assert _finishes(out)["pooled"][1:] == (int(FinishReason.STOP), [128.0, 1.0])
    (refusal,) = out.of(RequestError)
    assert refusal.request_id == "generating" and refusal.param == "prompt"


def test_embeddings_requests_never_speculate() -> None:
    out = PoolingWorker()
    config = Config().replace(
        scheduler={"async_scheduling": False, "max_num_batched_tokens": 4},
        speculative={"speculative": "ngram"},
    )
    core = EngineCore(config, out)
    core.on_worker_ready(_info())
    core.add(_request("gen"))
    core.add(_request("last", "last"))
    _run(core, out)
    key = sequence_key("last", 0)
    plans = [p for p in out.of(StepPlan) if key in p.req_ids]
    assert plans and all(
        not p.num_spec_tokens or not p.num_spec_tokens[p.req_ids.index(key)] for p in plans
    )
    assert any(p.num_spec_tokens for p in out.of(StepPlan))  # (the generating one did)
    assert _finishes(out)["last"][2] == [9.0, 1.0]
