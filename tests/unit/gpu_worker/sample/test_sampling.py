"""Sampling: greedy rows, temperature, min-p, top-k, top-p, per-request seeded generators, and
the logits controls (penalties, logit_bias, min_tokens, bad words) against a plain reference."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from common.messages.types import SamplingParams
from gpu_worker.sample.logits_controls import History, TokenCounts, apply_controls
from gpu_worker.sample.sampling import (
    apply_min_p,
    apply_top_k_top_p,
    greedy,
    make_generator,
    probabilities,
    sample,
)

CPU = torch.device("cpu")
VOCAB = 50


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("width", [1, 7, 50, 49152])
def test_greedy_is_argmax_with_ties_nan_and_infinities(width: int) -> None:
    """The first of equal largest values, a NaN where a row has one, -inf rows: as argmax."""
    gen = torch.Generator().manual_seed(width)
    logits = torch.randint(0, 3, (64, width), generator=gen).float()  # many ties
    logits[1] = float("-inf")
    logits[2, width // 2] = float("nan")
    logits[3, -1] = float("inf")
    assert torch.equal(greedy(logits), logits.argmax(dim=-1))


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


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, seed=3),
        SamplingParams(temperature=1.2, top_k=7, top_p=0.9, seed=4),
    ],
)
def test_a_resumed_generator_continues_the_seeded_sequence(params: SamplingParams) -> None:
    """A request resumed after k sampled tokens (its worker died) draws what it would have."""
    rows = _logits(12, seed=5)
    whole = make_generator(params, random.Random(0), CPU)
    tokens = [sample(rows[i : i + 1], [params], [whole])[0] for i in range(12)]
    for k in (1, 5, 11):
        resumed = make_generator(params, random.Random(0), CPU, num_drawn=k, vocab_size=VOCAB)
        assert [sample(rows[i : i + 1], [params], [resumed])[0] for i in range(k, 12)] == tokens[k:]


# --- today's plain path, pinned ------------------------------------------------------------

# the tokens the sampler gave these rows before logits controls existed (same seeds, logits)
PLAIN_GOLDEN = [
    [35, 33, 7, 22, 47],
    [2, 3, 34, 18, 39],
    [9, 43, 4, 43, 41],
    [11, 27, 45, 30, 7],
    [39, 43, 12, 17, 35],
    [25, 11, 15, 8, 12],
]
PLAIN_PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, seed=11),
    SamplingParams(temperature=1.0, top_k=5, seed=12),
    SamplingParams(temperature=1.3, top_p=0.8, seed=13),
    SamplingParams(temperature=0.9, top_k=10, top_p=0.9, seed=14),
]


def _golden_logits(step: int) -> torch.Tensor:
    return torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(1000 + step)) * 3


def test_plain_rows_give_todays_tokens() -> None:
    gens = _gens(PLAIN_PARAMS)
    got = [sample(_golden_logits(step), PLAIN_PARAMS, gens) for step in range(6)]
    assert got == PLAIN_GOLDEN


def test_plain_rows_beside_controlled_rows_give_todays_tokens() -> None:
    """Rows without controls are bit-identical whatever controlled rows share the batch."""
    controlled = [
        SamplingParams(
            temperature=0.0,
            repetition_penalty=1.5,
            logit_bias_token_ids=[3],
            logit_bias_values=[9.0],
        ),
        SamplingParams(
            temperature=0.8,
            seed=5,
            frequency_penalty=1.0,
            min_tokens=4,
            bad_words_token_ids=[[7], [1, 2]],
        ),
    ]
    params = [controlled[0], *PLAIN_PARAMS[:3], controlled[1], *PLAIN_PARAMS[3:]]
    plain_at = [1, 2, 3, 5, 6]
    gens = _gens(params)
    for i, g in zip(plain_at, _gens(PLAIN_PARAMS), strict=True):
        gens[i] = g  # the plain rows draw from the generators of the golden run
    rows = [_Row(f"r{i}", [4, 4, 9], 2, [2]) for i in range(len(params))]
    history = History(rows, TokenCounts(VOCAB, CPU))
    for step in range(6):
        golden = _golden_logits(step)
        logits = torch.randn(len(params), VOCAB) * 3
        logits[plain_at] = golden
        tokens = sample(logits, params, gens, history)
        assert [tokens[i] for i in plain_at] == PLAIN_GOLDEN[step]
        for row, token in zip(rows, tokens, strict=True):
            row.token_ids.append(token)


# --- logits controls against a plain reference ----------------------------------------------


@dataclasses.dataclass
class _Row:
    """A RowHistory: what the controls read about a request."""

    req_id: str
    token_ids: list[int]
    num_prompt: int
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)


def reference_controls(logits: torch.Tensor, p: SamplingParams, row: _Row) -> torch.Tensor:
    """One row's controls, token by token in float32, straight from their definitions."""
    x = logits.clone()
    output = row.token_ids[row.num_prompt :]
    for word in p.bad_words_token_ids:
        prefix = word[:-1]
        if not prefix or (len(output) >= len(prefix) and output[-len(prefix) :] == prefix):
            x[word[-1]] = float("-inf")
    if len(output) < p.min_tokens:
        for t in row.stop_token_ids:
            x[t] = float("-inf")
    for t, bias in zip(p.logit_bias_token_ids, p.logit_bias_values, strict=True):
        x[t] = x[t] + torch.tensor(bias, dtype=torch.float32)
    r = torch.tensor(p.repetition_penalty, dtype=torch.float32)
    for t in set(row.token_ids):  # prompt or output
        x[t] = x[t] / r if x[t] > 0 else x[t] * r
    f = torch.tensor(p.frequency_penalty, dtype=torch.float32)
    pres = torch.tensor(p.presence_penalty, dtype=torch.float32)
    for t in set(output):
        x[t] = x[t] - f * output.count(t)
        x[t] = x[t] - pres
    return x


def _random_row(rng: random.Random, req_id: str) -> _Row:
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))]
    output = [rng.randrange(10) for _ in range(rng.randrange(0, 15))]  # repeats likely
    return _Row(req_id, prompt + output, len(prompt), stop_token_ids=[0, 49])


CONTROLS = {
    "presence": SamplingParams(temperature=0.0, presence_penalty=1.5),
    "frequency": SamplingParams(temperature=0.7, frequency_penalty=0.8),
    "negative": SamplingParams(temperature=0.0, presence_penalty=-1.0, frequency_penalty=-0.5),
    "repetition": SamplingParams(temperature=0.0, repetition_penalty=1.7),
    "repetition<1": SamplingParams(temperature=0.9, repetition_penalty=0.6),
    "bias": SamplingParams(
        temperature=0.0, logit_bias_token_ids=[3, 40, 7], logit_bias_values=[100.0, -100.0, 2.5]
    ),
    "min_tokens": SamplingParams(temperature=0.0, min_tokens=10),
    "bad_words": SamplingParams(temperature=0.0, bad_words_token_ids=[[5], [1, 2], [3, 4, 6]]),
    "all": SamplingParams(
        temperature=0.5,
        presence_penalty=0.3,
        frequency_penalty=0.2,
        repetition_penalty=1.2,
        logit_bias_token_ids=[2],
        logit_bias_values=[-3.0],
        min_tokens=5,
        bad_words_token_ids=[[8], [4, 4], [9]],
    ),
}


@pytest.mark.parametrize("name", list(CONTROLS))
def test_each_control_matches_the_reference(name: str) -> None:
    rng = random.Random(name)
    params = [CONTROLS[name]] * 8
    rows = [_random_row(rng, f"r{i}") for i in range(8)]
    rows[0].token_ids[-3:] = [3, 4, 1]  # so bad-word prefixes ending the output come up
    logits = _logits(8, seed=len(name))
    got = apply_controls(logits, params, History(rows, TokenCounts(VOCAB, CPU)))
    for i in range(8):
        assert torch.equal(got[i], reference_controls(logits[i], params[i], rows[i])), i
    assert not torch.equal(got, logits)


def test_mixed_batch_controls_only_their_rows() -> None:
    rng = random.Random(1)
    plain = SamplingParams(temperature=0.8, top_k=5, seed=1)
    params = [
        plain,
        CONTROLS["all"],
        SamplingParams(),
        CONTROLS["repetition"],
        CONTROLS["repetition<1"],  # r < 1 beside r > 1 in one batch
        CONTROLS["bias"],  # no penalty: its row skips the counts
        plain,
    ]
    rows = [_random_row(rng, f"r{i}") for i in range(len(params))]
    logits = _logits(len(params), seed=3)
    before = logits.clone()
    got = apply_controls(logits, params, History(rows, TokenCounts(VOCAB, CPU)))
    assert torch.equal(logits, before)  # the input is not changed
    for i, p in enumerate(params):
        want = reference_controls(logits[i], p, rows[i]) if p.has_controls else logits[i]
        assert torch.equal(got[i], want), i


def test_greedy_rows_with_controls_take_the_argmax_of_the_controlled_logits() -> None:
    rng = random.Random(2)
    params = [CONTROLS[n] for n in ("presence", "repetition", "bias", "min_tokens", "bad_words")]
    rows = [_random_row(rng, f"r{i}") for i in range(len(params))]
    logits = _logits(len(params), seed=4)
    # make each control matter: the argmax is a token the control pushes down
    for i, row in enumerate(rows):
        target = {0: row.token_ids[-1], 1: row.token_ids[0], 2: 40, 3: 49, 4: 5}[i]
        if i == 0:
            row.token_ids.append(target)  # generated: the presence penalty applies
        logits[i, target] = logits[i].max() + 0.5
    tokens = sample(logits, params, [None] * len(params), History(rows, TokenCounts(VOCAB, CPU)))
    want = [int(reference_controls(logits[i], p, rows[i]).argmax()) for i, p in enumerate(params)]
    assert tokens == want
    assert all(t != int(logits[i].argmax()) for i, t in enumerate(tokens))


def test_min_tokens_masks_stop_ids_until_enough_are_out() -> None:
    p = SamplingParams(temperature=0.0, min_tokens=2)
    logits = torch.zeros(1, VOCAB)
    logits[0, 2] = 10.0  # the stop token is by far the likeliest
    row = _Row("a", [7, 7, 7], 3, stop_token_ids=[2])
    history = History([row], TokenCounts(VOCAB, CPU))
    got = []
    for _ in range(3):
        token = sample(logits, [p], [None], history)[0]
        got.append(token)
        row.token_ids.append(token)
    assert 2 not in got[:2] and got[2] == 2


def test_bad_word_prefixes_are_matched_in_the_output_only() -> None:
    p = SamplingParams(temperature=0.0, bad_words_token_ids=[[5, 6]])
    logits = torch.zeros(1, VOCAB)
    logits[0, 6] = 1.0
    prompt_ends_with_prefix = _Row("a", [1, 5], 2)  # no output yet: not banned (as vLLM)
    output_ends_with_prefix = _Row("b", [1, 5], 1)
    for row, banned in ((prompt_ends_with_prefix, False), (output_ends_with_prefix, True)):
        token = sample(logits, [p], [None], History([row], TokenCounts(VOCAB, CPU)))[0]
        assert (token != 6) == banned


def test_controls_need_the_history() -> None:
    with pytest.raises(AssertionError, match="history"):
        sample(_logits(1), [CONTROLS["bias"]], [None])


def test_seeded_row_with_controls_is_the_same_whatever_shares_the_batch() -> None:
    seeded = SamplingParams(temperature=0.9, seed=42, frequency_penalty=0.5, min_p=0.02)
    row_logits = _logits(1, seed=9)

    def run(batch_params: list[SamplingParams], at: int) -> list[int]:
        rows = [_Row(f"r{i}", [1, 2, 3], 3, [2]) for i in range(len(batch_params))]
        gens = _gens(batch_params, seed=at)
        gens[at] = make_generator(seeded, random.Random(0), CPU)
        history = History(rows, TokenCounts(VOCAB, CPU))
        out = []
        for step in range(15):
            logits = _logits(len(batch_params), seed=50 + step)
            logits[at] = row_logits[0]
            tokens = sample(logits, batch_params, gens, history)
            for row, token in zip(rows, tokens, strict=True):
                row.token_ids.append(token)
            out.append(tokens[at])
        return out

    alone = run([seeded], 0)
    mixed = run([SamplingParams(temperature=0.0), CONTROLS["all"], seeded, SamplingParams()], 2)
    assert mixed == alone
    assert len(set(alone)) > 1  # the frequency penalty moves it off its favourite


# --- min_p ----------------------------------------------------------------------------------


def test_min_p_drops_tokens_below_min_p_times_the_top_probability() -> None:
    logits = _logits(3, seed=6)
    out = apply_min_p(logits, [0.0, 0.1, 1.0])
    probs = logits.softmax(-1)
    assert torch.equal(out[0], logits[0])  # 0 = off, bit for bit
    kept = probs[1] >= 0.1 * probs[1].max()
    assert torch.equal(out[1].isfinite(), kept)
    assert torch.equal(out[1][kept], logits[1][kept])
    assert out[2].isfinite().sum() == 1 and out[2].argmax() == logits[2].argmax()


def test_min_p_applies_after_temperature_when_sampling() -> None:
    row = torch.tensor([[math.log(0.6), math.log(0.3), math.log(0.1)]])
    # p = [.6, .3, .1] at temperature 1: min_p 0.4 cuts below 0.24, keeping tokens 0 and 1
    assert _draws(row[0], SamplingParams(temperature=1.0, min_p=0.4, seed=1)) == {0, 1}
    # temperature 0.5 sharpens p to [.78, .2, .02]: the cut is 0.31, only token 0 is left
    assert _draws(row[0], SamplingParams(temperature=0.5, min_p=0.4, seed=1)) == {0}
    assert _draws(row[0], SamplingParams(temperature=1.0, seed=1)) == {0, 1, 2}


# --- token counts ---------------------------------------------------------------------------


def _bincount(tokens: list[int]) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens, dtype=torch.int64), minlength=VOCAB).int()


def test_token_counts_follow_each_requests_new_tokens() -> None:
    rng = random.Random(3)
    counts = TokenCounts(VOCAB, CPU)
    rows = [_random_row(rng, f"r{i}") for i in range(20)]  # more than one growth of capacity
    for step in range(6):
        batch = [r for i, r in enumerate(rows) if (i + step) % 3]  # not every row every step
        got_counts, got_prompt = counts.gather(batch)
        for j, row in enumerate(batch):
            assert torch.equal(got_counts[j], _bincount(row.token_ids[row.num_prompt :]))
            assert torch.equal(got_prompt[j], _bincount(row.token_ids[: row.num_prompt]) > 0)
        for row in rows:
            row.token_ids.extend(rng.randrange(VOCAB) for _ in range(rng.randrange(0, 3)))
    assert len(counts) == 20 and counts.capacity >= 20


def test_token_counts_reuse_a_released_row_from_zero() -> None:
    counts = TokenCounts(VOCAB, CPU)
    first = _Row("a", [1, 2, 3, 3, 3], 2)
    counts.gather([first])
    capacity = counts.capacity
    counts.release("a")
    counts.release("a")  # idempotent
    second = _Row("b", [9, 4], 1)
    got_counts, got_prompt = counts.gather([second])
    assert counts.capacity == capacity and len(counts) == 1
    assert torch.equal(got_counts[0], _bincount([4]))
    assert torch.equal(got_prompt[0], _bincount([9]) > 0)
    counts.clear()
    assert len(counts) == 0


def test_an_overflowing_logit_still_samples_it() -> None:
    """A repetition penalty near 0 (valid input) or a tiny temperature overflows a logit to
    +inf; the row must still sample (the largest logit), not fail on NaN probabilities."""
    logits = torch.tensor([[1.0, 3.0, float("inf"), -float("inf")], [2.0, 30.0, 1.0, 0.0]])
    params = [SamplingParams(temperature=0.7), SamplingParams(temperature=1e-37)]
    probs = probabilities(logits, params)
    assert torch.isfinite(probs).all() and probs[:, 1:3].sum(dim=1).min() > 0.99
    gens = [make_generator(p, random.Random(0), torch.device("cpu")) for p in params]
    assert sample(logits, params, gens) == [2, 1]
