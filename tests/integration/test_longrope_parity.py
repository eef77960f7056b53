"""Greedy parity with transformers for LongRoPE models (tiny Phi-3-mini-128k and Phi-4-mini
built from their configs with the sizes shrunk: original context 32, max 128; Phi-4-mini's
partial_rotary_factor 0.75), through the real scheduling policy and runner in this process.

    served context <= original   the short factors, as transformers for every call within
                                 it: prompts alone, then batched with chunked prefill
    served context >  original   the long factors, as transformers for a prompt that passes
                                 the original in one forward (and every step after it):
                                 alone, then batched with chunked prefill (whose first chunks
                                 sit within the original, still rotated by the long factors)

The choice is gpu_worker/models/rope.py's: one per server, by max_model_len. And the
Phi-4-mini checkpoint as a float32 GGUF file (llama.cpp's rope_factors_long/short tensors and
rope.dimension_count of 12): the folder's tokens.
"""

from __future__ import annotations

import pytest
import torch

from common.messages import SamplingParams
from gpu_worker.runner.model_runner import ModelRunner
from gpu_worker.runner.options import RunnerOptions
from services.scheduler.policy import PolicyConfig
from tests.engine import LocalEngine
from tests.gguf_models import Q, write_gguf
from tests.reference import hf_greedy
from tests.tiny_models import LONGROPE_ORIGINAL, VOCAB_SIZE, make_tiny_model

torch.set_num_threads(2)

NUM_NEW = 10
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
# (served context, prompt lengths): every sequence ends within the original in the first,
# every prompt passes it in the second
CASES = {
    "short": (LONGROPE_ORIGINAL, (3, 11, 21)),
    "long": (128, (LONGROPE_ORIGINAL + 1, 45, 70)),
}


@pytest.fixture(scope="module", params=["phi3-longrope", "phi4-mini"])
def model_path(request, tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp(request.param), request.param))


def _serve(engine, prompts: list[list[int]]) -> list[list[int]]:  # type: ignore[no-untyped-def]
    ids = [engine.add(p, GREEDY) for p in prompts]
    out = engine.run()
    return [out[seqs[0]] for seqs in ids]


def _prompts(lengths: tuple[int, ...]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, VOCAB_SIZE, (n,), generator=gen).tolist() for n in lengths]


def _runner(path: str, max_model_len: int) -> ModelRunner:
    options = RunnerOptions(
        block_size=4, num_blocks=256, num_threads=2, max_model_len=max_model_len
    )
    return ModelRunner(path, options)


@pytest.mark.parametrize("case", CASES)
def test_alone_then_batched_in_chunks(model_path: str, case: str) -> None:
    max_model_len, lengths = CASES[case]
    prompts = _prompts(lengths)
    assert all(n + NUM_NEW <= max_model_len for n in lengths)
    expected = [hf_greedy(model_path, p, NUM_NEW) for p in prompts]
    runner = _runner(model_path, max_model_len)
    for prompt, exp in zip(prompts, expected, strict=True):
        engine = LocalEngine(runner, PolicyConfig(max_num_batched_tokens=256))
        assert _serve(engine, [prompt]) == [exp]
    engine = LocalEngine(runner, PolicyConfig(max_num_batched_tokens=7), prefix_caching=False)
    assert _serve(engine, prompts) == expected


def test_a_phi4_mini_gguf_file_serves_as_its_folder(tmp_path) -> None:  # type: ignore[no-untyped-def]
    folder = make_tiny_model(tmp_path / "phi4-mini", "phi4-mini")
    path = tmp_path / "phi4-mini.gguf"
    write_gguf(folder, path, Q.F32, name="tiny phi4-mini")
    max_model_len, lengths = CASES["long"]
    prompts = _prompts(lengths)
    expected = [hf_greedy(folder, p, NUM_NEW) for p in prompts]
    runner = _runner(str(path), max_model_len)
    engine = LocalEngine(runner, PolicyConfig(max_num_batched_tokens=7), prefix_caching=False)
    assert _serve(engine, prompts) == expected
