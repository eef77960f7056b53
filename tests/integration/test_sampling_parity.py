"""Greedy parity of the logits controls with transformers' logits processors, on a tiny model.

Our side is the engine that ships (EngineCore plans, ModelRunner executes: InProcessEngine),
all requests in one run so controlled and plain rows share batches; the reference is the
transformers model loaded from the same folder, decoding greedily with the matching
processors: RepetitionPenaltyLogitsProcessor (repetition_penalty), NoBadWordsLogitsProcessor
(bad words), MinNewTokensLengthLogitsProcessor (min_tokens), SequenceBiasLogitsProcessor
(logit_bias), and a plain processor written here for OpenAI's presence/frequency penalties
(transformers has none). min_p changes no greedy choice;
tests/unit/gpu_worker/sample/test_sampling.py covers it. The run is repeated with a pool so small
that requests are preempted and recomputed, and with overlapped steps: a request's token
counts must survive both.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from common.messages.types import SamplingParams
from gpu_worker.runner.model_runner import ModelRunner
from gpu_worker.runner.options import RunnerOptions
from services.scheduler.policy import PolicyConfig
from tests.engine import LocalEngine
from tests.tiny_models import EOS_TOKEN_ID, make_tiny_model

torch.set_num_threads(2)

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama")


@pytest.fixture(scope="module")
def hf_model(tiny: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    # few distinct ids, so prompts and outputs share tokens and penalties have work to do
    pool = [rng.randrange(3, 49152) for _ in range(12)]
    return [[rng.choice(pool) for _ in range(n)] for n in (5, 9, 17, 23)]


class OpenAIPenalties:
    """presence/frequency penalties over the generated tokens, as OpenAI defines them (the
    reference; transformers has no such processor)."""

    def __init__(self, num_prompt: int, presence: float, frequency: float) -> None:
        self.num_prompt, self.presence, self.frequency = num_prompt, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        output = input_ids[0, self.num_prompt :]
        counts = torch.bincount(output, minlength=scores.shape[-1])[None].int()
        scores = scores - torch.tensor([[self.frequency]]) * counts
        return scores - torch.tensor([[self.presence]]) * (counts > 0)


def hf_processors(prompt: list[int], p: SamplingParams) -> list[Any]:
    """transformers' processors for p's controls, in the order the worker applies them."""
    from transformers.generation import logits_process as lp

    procs: list[Any] = []
    if p.bad_words_token_ids:
        procs.append(lp.NoBadWordsLogitsProcessor(p.bad_words_token_ids))
    if p.min_tokens:
        procs.append(lp.MinNewTokensLengthLogitsProcessor(len(prompt), p.min_tokens, EOS_TOKEN_ID))
    if p.logit_bias_token_ids:
        pairs = zip(p.logit_bias_token_ids, p.logit_bias_values, strict=True)
        procs.append(lp.SequenceBiasLogitsProcessor([[[t], b] for t, b in pairs]))
    if p.repetition_penalty != 1.0:
        procs.append(lp.RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    if p.presence_penalty or p.frequency_penalty:
        procs.append(OpenAIPenalties(len(prompt), p.presence_penalty, p.frequency_penalty))
    return procs


def hf_generate(model: Any, prompt: list[int], p: SamplingParams) -> list[int]:
    """Greedy with p's processors; stops after EOS unless ignore_eos (as our scheduler)."""
    ids = torch.tensor([prompt])
    procs = hf_processors(prompt, p)
    with torch.no_grad():
        for _ in range(p.max_tokens):
            scores = model(input_ids=ids).logits[:, -1, :].float()
            for proc in procs:
                scores = proc(ids, scores)
            token = scores.argmax(-1)
            ids = torch.cat([ids, token[:, None]], dim=1)
            if int(token) == EOS_TOKEN_ID and not p.ignore_eos:
                break
    return ids[0, len(prompt) :].tolist()


def _cases(plain: list[list[int]], prompts: list[list[int]]) -> list[tuple[int, SamplingParams]]:
    """(prompt index, params) of every request; bad words are cut from the plain outputs so
    they surely come up, and never start at the prompt's end (transformers matches bad-word
    prefixes in the prompt too, vLLM and we in the output only)."""
    out0, out1 = plain[0], plain[1]
    assert prompts[0][-1] != out0[3] and prompts[1][-1] != out1[0]
    bad = [[out0[3], out0[4]], [out0[6]]]  # a two-token word and a one-token word
    cases = [
        (0, GREEDY),
        (1, dataclasses.replace(GREEDY, repetition_penalty=1.8)),
        (2, dataclasses.replace(GREEDY, repetition_penalty=0.5)),  # < 1 favours repeats
        (0, dataclasses.replace(GREEDY, presence_penalty=1.5, frequency_penalty=0.7)),
        (0, dataclasses.replace(GREEDY, bad_words_token_ids=bad)),
        (
            1,  # pushed to EOS from the first token, held off it for min_tokens
            dataclasses.replace(
                GREEDY,
                ignore_eos=False,
                min_tokens=5,
                logit_bias_token_ids=[EOS_TOKEN_ID],
                logit_bias_values=[40.0],
            ),
        ),
        (
            2,  # the plain output's first tokens banned by bias, another one favoured
            dataclasses.replace(
                GREEDY,
                logit_bias_token_ids=sorted({plain[2][0], plain[2][1], 777}),
                logit_bias_values=[
                    -100.0 if t != 777 else 3.0 for t in sorted({*plain[2][:2], 777})
                ],
            ),
        ),
        (
            3,  # everything at once
            dataclasses.replace(
                GREEDY,
                repetition_penalty=1.3,
                presence_penalty=0.5,
                frequency_penalty=-0.4,
                logit_bias_token_ids=[plain[3][2]],
                logit_bias_values=[-8.0],
                min_tokens=3,
                ignore_eos=False,
                bad_words_token_ids=[[out1[0], out1[1]], [out1[4]]],
                min_p=0.2,  # no effect on a greedy choice
            ),
        ),
        (1, dataclasses.replace(GREEDY, temperature=0.0, top_k=1, repetition_penalty=1.8)),
    ]
    return cases


@pytest.mark.parametrize(
    ("overlap", "num_blocks"),
    [(False, None), (True, 10)],  # 10 blocks of 16 tokens: preemption by recompute
)
def test_greedy_controls_equal_transformers_processors(
    tiny: Path, hf_model: Any, overlap: bool, num_blocks: int | None
) -> None:
    prompts = _prompts()
    plain = [hf_generate(hf_model, p, GREEDY) for p in prompts]
    cases = _cases(plain, prompts)
    want = [hf_generate(hf_model, prompts[i], p) for i, p in cases]

    runner = ModelRunner(str(tiny), RunnerOptions(num_blocks=64))
    engine = LocalEngine(
        runner,
        PolicyConfig(max_num_batched_tokens=64),
        overlap=overlap,
        prefix_caching=False,
        num_blocks=num_blocks,
    )
    seqs = [engine.add(prompts[i], p)[0] for i, p in cases]
    out = engine.run()
    got = [out[s] for s in seqs]
    for k, (_, p) in enumerate(cases):
        assert got[k] == want[k], (k, p)
    assert got[0] == plain[0]  # the plain row beside controlled ones
    # the controls changed what the plain run would have given
    assert all(want[k] != plain[i] for k, (i, _) in enumerate(cases) if k != 0)
    assert len(want[5]) == 6 and want[5][-1] == EOS_TOKEN_ID  # 5 held, then EOS
    if num_blocks is not None:
        assert engine.policy.num_preemptions > 0
