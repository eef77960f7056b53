"""Embeddings on the worker (gpu_worker/sample/pooling.py): the real ModelRunner on a tiny random
model pools the final-normed hidden states of embeddings requests, chunked or not, in a step
beside a generating request, equal to transformers' `last_hidden_state` pooled the same way;
the synthetic runner answers a vector in the same place."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.messages import SamplingParams, StepPlan, StepResult
from common.model_paths import prepare_synthetic_folder
from gpu_worker.runner.model_runner import ModelRunner
from gpu_worker.runner.options import RunnerOptions
from gpu_worker.runner.request_table import RequestState
from gpu_worker.runner.synthetic import SyntheticRunner
from gpu_worker.sample.pooling import PoolBatch, PoolRows
from tests.reference import hf_pooled
from tests.tiny_models import make_tiny_model

BLOCK_SIZE = 4
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
LAST = SamplingParams(max_tokens=1, temperature=0.0, pooling="last")
MEAN = SamplingParams(max_tokens=1, temperature=0.0, pooling="mean")
A, B, C = [5, 6, 7], [11, 12, 13, 14, 15, 16], [21, 22, 23, 24, 25, 26, 27]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama")


def _plan(
    step: int,
    batch: list[tuple[str, int, int, list[int]]],
    new: dict[str, tuple[list[int], SamplingParams]] | None = None,
    **diffs: list[str],
) -> StepPlan:
    new = new or {}
    return StepPlan(
        step,
        new_req_ids=list(new),
        new_prompt_token_ids=[prompt for prompt, _ in new.values()],
        new_sampling=[sampling for _, sampling in new.values()],
        req_ids=[rid for rid, _, _, _ in batch],
        num_computed_tokens=[c for _, c, _, _ in batch],
        num_new_tokens=[n for _, _, n, _ in batch],
        new_block_ids=[b for _, _, _, b in batch],
        **diffs,
    )


def _close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-4)


def _vectors(result: StepResult) -> dict[str, list[float]]:
    return dict(zip(result.pooled_req_ids, result.embeddings, strict=True))


def test_pooled_vectors_equal_transformers_in_a_mixed_chunked_batch(tiny_dir: Path) -> None:
    runner = ModelRunner(str(tiny_dir), RunnerOptions(block_size=BLOCK_SIZE, num_blocks=16))
    new = {"a": (A, GREEDY), "b": (B, LAST), "c": (C, MEAN)}
    # step 0: a's prompt (it samples), b's whole prompt, c's first chunk of 4
    first = runner.execute(_plan(0, [("a", 0, 3, [0]), ("b", 0, 6, [1, 2]), ("c", 0, 4, [3])], new))
    assert first.req_ids == ["a"] and len(first.token_ids) == 1
    assert first.pooled_req_ids == ["b"]  # c is not done: it samples nothing either
    _close(_vectors(first)["b"], hf_pooled(tiny_dir, B, "last"))
    # step 1: a decodes beside c's last chunk of 3
    second = runner.execute(_plan(1, [("a", 3, 1, []), ("c", 4, 3, [4])]))
    assert second.req_ids == ["a"] and second.pooled_req_ids == ["c"]
    _close(_vectors(second)["c"], hf_pooled(tiny_dir, C, "mean"))
    state = runner.requests.get("c")
    assert state is not None and state.output_ids == []  # no token: the request is done


def test_a_recomputed_mean_request_starts_its_sum_afresh(tiny_dir: Path) -> None:
    runner = ModelRunner(str(tiny_dir), RunnerOptions(block_size=BLOCK_SIZE, num_blocks=16))
    runner.execute(_plan(0, [("c", 0, 4, [0])], {"c": (C, MEAN)}))
    # preempted by recompute: its KV is gone, its prompt comes back from position 0
    again = runner.execute(_plan(1, [("c", 0, 7, [5, 6])], preempted_req_ids=["c"]))
    _close(_vectors(again)["c"], hf_pooled(tiny_dir, C, "mean"))


def test_last_pooling_with_a_prefix_hit_computes_only_the_tail(tiny_dir: Path) -> None:
    runner = ModelRunner(str(tiny_dir), RunnerOptions(block_size=BLOCK_SIZE, num_blocks=16))
    runner.execute(_plan(0, [("x", 0, 6, [1, 2])], {"x": (B, LAST)}))
    # y shares x's first block (a prefix-cache hit): only positions 4.. run
    got = runner.execute(_plan(1, [("y", 4, 2, [1, 3])], {"y": (B, LAST)}))
    _close(_vectors(got)["y"], hf_pooled(tiny_dir, B, "last"))


def test_mean_pooling_refuses_a_first_chunk_past_position_0(tiny_dir: Path) -> None:
    runner = ModelRunner(str(tiny_dir), RunnerOptions(block_size=BLOCK_SIZE, num_blocks=16))
    runner.execute(_plan(0, [("x", 0, 6, [1, 2])], {"x": (B, LAST)}))
    with pytest.raises(ValueError, match="mean pooling needs every prompt position"):
        runner.execute(_plan(1, [("y", 4, 2, [1, 3])], {"y": (B, MEAN)}))


def test_pool_batch_sums_chunks_in_float32_and_restarts() -> None:
    state = RequestState("m", [1, 2, 3, 4], MEAN, 4, "v")
    hidden = torch.arange(8, dtype=torch.bfloat16).reshape(4, 2)
    indices = torch.tensor([0, 1])
    state.num_computed = 2
    assert PoolBatch([PoolRows(state, 2, True)], indices).accumulate(hidden[:2]) == {}
    state.num_computed = 4
    got = PoolBatch([PoolRows(state, 2, False)], indices).accumulate(hidden[2:])
    assert got == {"m": [3.0, 4.0]}  # mean of rows [0,1], [2,3], [4,5], [6,7]
    assert state.pool_sum is not None and state.pool_sum.dtype == torch.float32
    state.num_computed = 2  # a recompute: the sum starts again at position 0
    PoolBatch([PoolRows(state, 2, True)], indices).accumulate(hidden[:2])
    assert state.pool_sum.tolist() == [2.0, 4.0]


def test_the_synthetic_runner_answers_a_vector_for_an_embeddings_request(
    tmp_path: Path, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHUTTLE_CACHE_DIR", str(tmp_path))
    runner = SyntheticRunner(str(prepare_synthetic_folder("synthetic", tiny_dir)), block_size=4)
    first = runner.execute(
        _plan(0, [("a", 0, 3, [0]), ("c", 0, 4, [1])], {"a": (A, GREEDY), "c": (C, MEAN)})
    )
    assert first.req_ids == ["a"] and first.pooled_req_ids == []
    second = runner.execute(_plan(1, [("c", 4, 3, [2])]))
    assert (
        second.req_ids == [] and second.pooled_req_ids == ["c"] and len(second.embeddings[0]) == 8
    )
