"""Mixture-of-experts GGUF files in llama.cpp's layout (tests/gguf_moe_models.py: stacked
3-D experts, router, shared expert) served as they are: Qwen2-MoE (shared expert) in F32,
Q8_0 and Q4_1, Qwen3-MoE in Q4_1, Mixtral (a "llama" file with experts, q/k rows permuted)
in F32 and Q4_1, OLMoE (an "olmoe" file: whole-projection q/k norms) in F32 and Q8_0.

The reference for Qwen-MoE is transformers loading the same GGUF file (its qwen2moe/qwen3moe
GGUF support dequantizes every tensor to float32). Its GGUF config mapping does not read the
experts' widths (`expert_feed_forward_length`, `expert_shared_feed_forward_length`), so it
is given the model's config.json beside the file; the weights are the file's. transformers
does not read a Mixtral GGUF (it would load a dense llama) nor an OLMoE one (no olmoe in its
GGUF architectures): their reference is transformers on the dequantized weights the file
stands for, saved as a Hugging Face folder.

    torch kernels  GGUF experts dequantized at load, float arithmetic: transformers' tokens
                   for every type
    C kernels      F32: transformers' tokens; Q8_0 / Q4_1 by gguf.c, whose activations are
                   rounded to int8 per 32 values as llama.cpp's are (so not transformers'
                   float arithmetic): a token's result is the same bits alone, in a batch,
                   chunked and after preemption, and the tokens mostly agree with the
                   reference
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gpu_worker.layers.fused_moe import FusedMoE
from gpu_worker.layers.moe_methods.gguf import GGUFMoEMethod
from gpu_worker.runner.model_runner import ModelRunner
from gpu_worker.runner.options import RunnerOptions
from tests.gguf_moe_models import hf_folder_of, write_moe_gguf
from tests.integration.test_model_parity import hf_greedy, run_greedy
from tests.tiny_models import VOCAB_SIZE
from tests.tiny_moe_models import make_tiny_moe_model

torch.set_num_threads(2)

NUM_NEW = 10
PROMPT_LENS = (1, 5, 17, 40)
# llama.cpp's qwen2moe/qwen3moe have experts in every layer (and qwen3moe renormalises)
ALL_SPARSE: dict[str, dict] = {
    "qwen2_moe": dict(decoder_sparse_step=1),
    "qwen3_moe": dict(mlp_only_layers=[]),
    "mixtral": {},
    "olmoe": {},
}
# (each file costs a tokenizer folder and a transformers load: Qwen3-MoE in one type)
CASES = [
    ("qwen2_moe", Q.F32),
    ("qwen2_moe", Q.Q8_0),
    ("qwen2_moe", Q.Q4_1),
    ("qwen3_moe", Q.Q4_1),
    ("mixtral", Q.F32),
    ("mixtral", Q.Q4_1),
    ("olmoe", Q.F32),
    ("olmoe", Q.Q8_0),
]
FOLDER_REFERENCE = ("mixtral", "olmoe")  # transformers reads no GGUF of theirs
IDS = [f"{arch}-{q.name}" for arch, q in CASES]


@functools.lru_cache(maxsize=8)
def _file(root: str, arch: str, qtype: Q) -> Path:
    folder = make_tiny_moe_model(Path(root) / arch, arch, **ALL_SPARSE[arch])
    path = Path(root) / f"{arch}-{qtype.name}.gguf"
    expected = write_moe_gguf(folder, path, qtype)
    if arch in FOLDER_REFERENCE:  # the float weights the file stands for, as a folder
        hf_folder_of(expected, folder, Path(root) / f"{arch}-{qtype.name}-dequantized")
    return path


@functools.lru_cache(maxsize=8)
def _reference(root: str, arch: str, qtype: Q) -> tuple[list[list[int]], list[list[int]]]:
    from transformers import AutoConfig, AutoModelForCausalLM

    path = _file(root, arch, qtype)
    if arch in FOLDER_REFERENCE:
        folder = Path(root) / f"{arch}-{qtype.name}-dequantized"
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    else:
        config = AutoConfig.from_pretrained(Path(root) / arch)
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, config=config, dtype=torch.float32
        ).eval()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB_SIZE, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    return prompts, [hf_greedy(model, p, NUM_NEW) for p in prompts]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("moe-gguf"))


@pytest.mark.parametrize(("arch", "qtype"), CASES, ids=IDS)
def test_gguf_moe_torch_kernels_match_transformers(root: str, arch: str, qtype: Q) -> None:
    prompts, expected = _reference(root, arch, qtype)
    runner = ModelRunner(
        str(_file(root, arch, qtype)), RunnerOptions(num_blocks=256, cpu_kernels=False)
    )
    assert run_greedy(runner, prompts, NUM_NEW, together=False) == expected
    assert run_greedy(runner, prompts, NUM_NEW, token_budget=7) == expected


@pytest.mark.parametrize(("arch", "qtype"), CASES, ids=IDS)
def test_gguf_moe_c_kernels(root: str, arch: str, qtype: Q) -> None:
    prompts, expected = _reference(root, arch, qtype)
    runner = ModelRunner(str(_file(root, arch, qtype)), RunnerOptions(block_size=4, num_blocks=256))
    experts = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    assert len(experts) == runner.model.config.num_layers
    assert runner.model.model.one_call_step is not None  # decode steps in one C call
    alone = run_greedy(runner, prompts, NUM_NEW, together=False)
    if qtype == Q.F32:
        assert alone == expected
        return
    assert all(
        isinstance(e.method, GGUFMoEMethod) and e.method.storage == f"gguf:{qtype.name}"
        for e in experts
    )
    assert run_greedy(runner, prompts, NUM_NEW) == alone
    assert run_greedy(runner, prompts, NUM_NEW, token_budget=5) == alone
    # int8 activations (llama.cpp's arithmetic) against float ones: most tokens agree
    first = sum(a[0] == b[0] for a, b in zip(alone, expected, strict=True))
    assert first >= len(prompts) - 1
