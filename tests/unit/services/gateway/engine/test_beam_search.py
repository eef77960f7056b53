"""Beam search (services/gateway/engine/beam_search.py): the choice of beams equals transformers'
`generate(num_beams=...)` on the same weights (a tiny random model with a 16-token
vocabulary, so EOS is often among the candidates and beams finish early), and the HTTP
route drives one-token engine steps over the scripted engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.gateway.engine.beam_search import Beam, BeamSearch
from tests.fake_engine import FakeEngine
from tests.tiny_models import make_tiny_model
from tests.unit.services.gateway.http.test_app import COMPLETIONS, run

VOCAB, EOS = 16, 2
PROMPT = [5, 7, 3, 9]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> list[torch.nn.Module]:
    import transformers

    root = tmp_path_factory.mktemp("beams")
    out = []
    for seed in range(3):
        folder = make_tiny_model(Path(root / f"m{seed}"), vocab_size=VOCAB, seed=seed)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        out.append(model.eval())
    return out


def _ours(model: torch.nn.Module, beams: int, max_tokens: int, penalty: float) -> list[Beam]:
    search = BeamSearch(beams, max_tokens, [EOS], penalty)
    while not search.is_done:
        candidates = []
        for beam in search.running:
            ids = torch.tensor([PROMPT + list(beam.token_ids)])
            with torch.no_grad():
                logprobs = torch.log_softmax(model(ids).logits[0, -1].float(), dim=-1)
            top = logprobs.topk(min(search.num_candidates, VOCAB))
            candidates.append(list(zip(top.indices.tolist(), top.values.tolist(), strict=True)))
        search.step(candidates)
    return search.best(beams)


def _theirs(model: torch.nn.Module, beams: int, max_tokens: int, penalty: float) -> list[list[int]]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([PROMPT]),
            attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
            num_beams=beams,
            num_return_sequences=beams,
            max_new_tokens=max_tokens,
            do_sample=False,
            early_stopping=False,
            length_penalty=penalty,
            eos_token_id=EOS,
            pad_token_id=EOS,
        )
    sequences = []
    for row in out[:, len(PROMPT) :].tolist():
        sequences.append(row[: row.index(EOS) + 1] if EOS in row else row)
    return sequences


@pytest.mark.parametrize("beams,max_tokens,penalty", [(2, 6, 1.0), (3, 8, 1.0), (4, 7, 0.5)])
def test_the_beams_equal_transformers_generate(
    models: list[torch.nn.Module], beams: int, max_tokens: int, penalty: float
) -> None:
    finished_early = 0
    for model in models:
        ours = _ours(model, beams, max_tokens, penalty)
        assert [list(b.token_ids) for b in ours] == _theirs(model, beams, max_tokens, penalty)
        finished_early += sum(b.is_eos for b in ours)
    assert finished_early  # (the test's meaning: some beams ended on EOS)


def test_beam_search_over_http_asks_one_token_steps() -> None:
    engine = FakeEngine()  # its logprobs: ids 100, 101, ... at -1, -2, ...
    body = {"prompt": "ab", "use_beam_search": True, "n": 2, "max_tokens": 3}
    out = run(engine, "POST", COMPLETIONS, json=body).json()
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert out["choices"][0]["text"] == chr(100) * 3  # the best: the top token each step
    assert out["choices"][0]["finish_reason"] == "length"
    steps = [r for r in engine.requests if r.request_id.startswith(out["id"])]
    assert all(r.sampling.max_tokens == 1 and r.sampling.logprobs == 4 for r in steps)
    assert steps[-1].prompt_token_ids[:3] == [1, ord("a"), ord("b")]  # prompt, then the beam
    assert out["usage"]["completion_tokens"] == 6
