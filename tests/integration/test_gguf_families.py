"""GGUF files of the families with their own attention, in llama.cpp's layout
(tests/gguf_models.py), served as they are: Gemma 2 (soft caps, alternating windows, norms
stored +1, four norms a layer), Gemma 3 (5 sliding : 1 global layers, a local rope base, a
linear-scaled global rope, q/k norms), SmolLM3 (every 4th layer without rope, q/k rows
permuted) and a Mistral with a window of 16 on every layer. Prompts cross the windows.

The reference is transformers loading the same GGUF file where it reads the family (Gemma 2
and Gemma 3; it dequantizes every tensor to float32 and takes Gemma's 1 off the norms). Its
GGUF config mapping reads neither the soft caps, the window pattern nor the local rope, so it
is given the model's config.json beside the file; the weights are the file's. transformers
reads no SmolLM3 GGUF, nor a "llama" file as a windowed Mistral (its weight mapping knows no
"mistral" architecture): their reference is transformers on the float weights the file
stands for, saved as a Hugging Face folder.

A GGUF file has no key for Gemma's query_pre_attn_scalar (llama.cpp takes head_dim, or
hidden / heads for a 27B): the tiny Gemma 2, whose 24 is neither, is written with head_dim.
Quantized files run on the torch kernels (blocks dequantized at load, float arithmetic as
transformers'); the F32 file on the C kernels the CPU worker uses.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from common.model_paths import tokenizer_dir
from gpu_worker.runner.model_runner import ModelRunner
from gpu_worker.runner.options import RunnerOptions
from tests.gguf_models import write_gguf
from tests.gguf_moe_models import hf_folder_of
from tests.integration.test_model_parity import hf_greedy, run_greedy
from tests.tiny_models import VOCAB_SIZE, make_tiny_model

torch.set_num_threads(2)

NUM_NEW = 10
PROMPT_LENS = (1, 5, 17, 40)  # windows of 16: up to two windows deep
CASES = [("gemma2", Q.Q8_0), ("gemma3", Q.Q4_1), ("smollm3", Q.Q8_0), ("mistral-window", Q.F32)]
IDS = [f"{arch}-{q.name}" for arch, q in CASES]
TRANSFORMERS_READS = ("gemma2", "gemma3")


def _folder(root: Path, arch: str) -> Path:
    folder = make_tiny_model(root / arch, arch)
    if arch == "gemma2":  # (see the module's docstring)
        config = json.loads((folder / "config.json").read_text())
        config["query_pre_attn_scalar"] = config["head_dim"]
        (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


@functools.lru_cache(maxsize=8)
def _file(root: str, arch: str, qtype: Q) -> Path:
    folder = _folder(Path(root), arch)
    path = Path(root) / f"{arch}-{qtype.name}.gguf"
    expected = write_gguf(folder, path, qtype, name=f"tiny {arch}")
    if arch not in TRANSFORMERS_READS:  # the float weights the file stands for, as a folder
        hf_folder_of(expected, folder, Path(root) / f"{arch}-{qtype.name}-dequantized")
    return path


@functools.lru_cache(maxsize=8)
def _reference(root: str, arch: str, qtype: Q) -> tuple[list[list[int]], list[list[int]]]:
    from transformers import AutoConfig, AutoModelForCausalLM

    path = _file(root, arch, qtype)
    if arch in TRANSFORMERS_READS:
        config = AutoConfig.from_pretrained(Path(root) / arch)
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, config=config, dtype=torch.float32
        ).eval()
    else:
        folder = Path(root) / f"{arch}-{qtype.name}-dequantized"
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB_SIZE, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    return prompts, [hf_greedy(model, p, NUM_NEW) for p in prompts]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("gguf-families"))


@pytest.mark.parametrize(("arch", "qtype"), CASES, ids=IDS)
def test_gguf_family_matches_transformers(root: str, arch: str, qtype: Q) -> None:
    prompts, expected = _reference(root, arch, qtype)
    options = RunnerOptions(block_size=4, num_blocks=256, cpu_kernels=qtype == Q.F32)
    runner = ModelRunner(str(_file(root, arch, qtype)), options)
    assert runner.model.config.model_type == {"gemma3": "gemma3_text"}.get(arch, arch.split("-")[0])
    assert run_greedy(runner, prompts, NUM_NEW, together=False) == expected
    assert run_greedy(runner, prompts, NUM_NEW, token_budget=7) == expected


@pytest.mark.parametrize("arch", ["gemma3", "smollm3"])
def test_the_files_chat_template_is_served(root: str, arch: str) -> None:
    """The tokenizer folder written from the file (every process's tokenizer) renders chats
    with the file's tokenizer.chat_template."""
    from transformers import AutoTokenizer

    path = _file(root, arch, dict(CASES)[arch])
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir(path))
    template = (Path(root) / arch / "chat_template.jinja").read_text()
    assert tokenizer.chat_template == template
    chat = [{"role": "user", "content": "hello"}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert "hello" in text and text.endswith("assistant\n")
