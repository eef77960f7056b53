"""Sampling: greedy rows, temperature, top-k, top-p, and per-request seeded generators."""

from __future__ import annotations

import math
import random

import torch

from common.messages.types import SamplingParams
from gpu_worker.sampling import apply_top_k_top_p, make_generator, sample

CPU = torch.device("cpu")
VOCAB = 50


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _gens(params: list[SamplingParams], seed: int = 0) -> list[torch.Generator | None]:
    rng = random.Random(seed)
    return [make_generator(p, rng, CPU) for p in params]


def test_greedy_rows_take_the_argmax() -> None:
    logits = _logits(4)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, seed=3),
        SamplingParams(temperature=0.0, top_p=0.5),
    ]
    tokens = sample(logits, params, _gens(params))
    argmax = logits.argmax(-1).tolist()
    assert [tokens[i] for i in (0, 1, 3)] == [argmax[i] for i in (0, 1, 3)]
    assert make_generator(params[0], random.Random(0), CPU) is None


def _draws(row: torch.Tensor, params: SamplingParams, n: int = 300) -> set[int]:
    gen = make_generator(params, random.Random(0), CPU)
    return {sample(row[None], [params], [gen])[0] for _ in range(n)}


def test_top_k_keeps_only_the_k_largest() -> None:
    row = _logits(1)[0] / 3  # flat enough that all k are drawn
    top3 = set(row.topk(3).indices.tolist())
    assert _draws(row, SamplingParams(temperature=1.0, top_k=3, seed=1)) == top3
    assert len(_draws(row, SamplingParams(temperature=1.0, top_k=0, seed=1))) > 10


def test_top_p_keeps_the_smallest_nucleus_reaching_p() -> None:
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log()[None]
    kept = apply_top_k_top_p(logits, [0], [0.7]).isfinite()[0]
    assert kept.tolist() == [False, True, False, True]  # 0.5 + 0.3 >= 0.7
    kept = apply_top_k_top_p(logits, [0], [0.85]).isfinite()[0]
    assert kept.tolist() == [False, True, True, True]
    kept = apply_top_k_top_p(logits, [0], [0.01]).isfinite()[0]
    assert kept.tolist() == [False, True, False, False]  # the top token always survives


def test_top_k_and_top_p_are_per_row() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]] * 3)
    out = apply_top_k_top_p(logits, [2, 0, 0], [1.0, 1.0, 0.5])
    assert out.isfinite().tolist() == [
        [False, False, True, True],
        [True, True, True, True],
        [False, False, False, True],
    ]
    kept = out[0][out[0].isfinite()]
    assert kept.tolist() == [2.0, 3.0]  # surviving logits are unchanged


def test_low_temperature_approaches_greedy() -> None:
    logits = _logits(6)
    params = [SamplingParams(temperature=1e-4, seed=i) for i in range(6)]
    assert sample(logits, params, _gens(params)) == logits.argmax(-1).tolist()


def test_temperature_reshapes_the_distribution() -> None:
    row = torch.tensor([0.0, math.log(3.0)])  # p = [0.25, 0.75] at temperature 1
    gen = make_generator(SamplingParams(seed=5), random.Random(0), CPU)
    hot = SamplingParams(temperature=100.0, seed=5)  # nearly uniform
    hits = sum(sample(row[None], [hot], [gen])[0] for _ in range(2000))
    assert 850 < hits < 1150


def test_seeded_row_is_the_same_whatever_shares_the_batch() -> None:
    seeded = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=42)
    row = _logits(1, seed=9)
    alone_gen = _gens([seeded])
    alone = [sample(row, [seeded], alone_gen)[0] for _ in range(20)]
    others = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)]
    params = [others[0], seeded, others[1]]
    gens = _gens(params, seed=123)
    batched = []
    for step in range(20):
        batch = torch.cat([_logits(1, seed=100 + step), row, _logits(1, seed=200 + step)])
        batched.append(sample(batch, params, gens)[1])
    assert batched == alone
    assert len(set(alone)) > 1


def test_unseeded_generators_come_from_the_runner_rng() -> None:
    params = [SamplingParams(temperature=1.0)] * 3
    row = _logits(1)
    first = [sample(row, [p], [g])[0] for p, g in zip(params, _gens(params, seed=7), strict=True)]
    again = [sample(row, [p], [g])[0] for p, g in zip(params, _gens(params, seed=7), strict=True)]
    assert first == again
