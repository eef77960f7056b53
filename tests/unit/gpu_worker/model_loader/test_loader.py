"""The loader (gpu_worker/model_loader/loader.py) places every weight on the model's device.

Each checkpoint format is loaded for torch's "meta" device (no memory, no kernel runs), with
the kernel choice of each device kind, and LoRA slots attached: every parameter and buffer
of the model, and every tensor a linear method (or the LoRA method around it) holds, must be
on "meta". A tensor left on the CPU is one a GPU's first forward would fail on.

The CPU's C-kernel choice on "meta" stands for "the C kernels' method on a device that is
not the CPU": its packing (oneDNN's packed copy, made at process_weights_after_loading) is
skipped there, as the Triton and torch choices never pack, so its methods hold no packed
copy. (The one-call decode step is the CPU's own and is not asked for here.)
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file

from gpu_worker.attention import create_backend
from gpu_worker.layers.kernel_choice import TORCH_KERNELS, KernelChoice
from gpu_worker.layers.linear import Linear, quantization_of
from gpu_worker.lora.layer import enable_lora
from gpu_worker.model_loader.hf_folder import read_hf_config
from gpu_worker.model_loader.loader import load_model
from gpu_worker.models.llama import LlamaForCausalLM
from gpu_worker.models.llama_config import LlamaConfig
from tests.gguf_models import make_tiny_k_model, write_gguf
from tests.tiny_models import make_tiny_model, make_tiny_model_own_vocab
from tools.export_int8 import export_int8

META = torch.device("meta")
KERNELS = {
    "torch": TORCH_KERNELS,
    "triton": KernelChoice(triton_linears=True),  # CUDA's linears (the layer ops: torch's)
    "cpu": KernelChoice(cpu_linears=True),  # the C kernels' methods, off the CPU: no packing
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str, str]]:
    """name -> (model path, --quantization, the storage quantization_of must report). Small
    vocabularies (600 tokens), so that GGUF embeddings dequantize in no time."""
    root = tmp_path_factory.mktemp("placement")
    qwen2 = make_tiny_model(root / "qwen2", "qwen2", vocab_size=600)  # q/k/v biases
    llama = make_tiny_model_own_vocab(root / "llama")  # (GGUF files need a tokenizer)
    k_model = make_tiny_k_model(root / "k")
    write_gguf(_tied(llama, root / "tied"), root / "q8_0.gguf", Q.Q8_0)  # LM head: blocks
    write_gguf(llama, root / "q4_1.gguf", Q.Q4_1)
    v_proj = {f"model.layers.{i}.self_attn.v_proj.weight": Q.Q6_K for i in range(2)}
    write_gguf(k_model, root / "q4_k_m.gguf", Q.Q4_K, overrides=v_proj)  # two shards in qkv
    return {
        "float": (qwen2, "", ""),
        "gguf Q8_0 tied": (root / "q8_0.gguf", "", "gguf:Q8_0"),
        "gguf Q4_1": (root / "q4_1.gguf", "", "gguf:Q4_1"),
        "gguf Q4_K+Q6_K": (root / "q4_k_m.gguf", "", "gguf:Q4_K+Q6_K"),
        "int8 compressed-tensors": (export_int8(qwen2, root / "int8", smoothquant=0), "", "int8"),
        "--quantization int8": (qwen2, "int8", "int8"),
    }


def _tied(folder: Path, copy: Path) -> Path:
    """The model with its LM head tied to the embedding (no lm_head.weight in the file)."""
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    tensors = load_file(str(copy / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(copy / "model.safetensors"))
    return copy


def _load(path: Path, kernels: KernelChoice, quantization: str) -> LlamaForCausalLM:
    cfg = LlamaConfig.from_hf(read_hf_config(path))
    backend = create_backend(
        "torch",
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=torch.float32,
        device=META,
    )
    return load_model(
        path,
        backend,
        dtype=torch.float32,
        device=META,
        max_positions=64,
        kernels=kernels,
        quantization=quantization,
    )


def _held(obj: object, where: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor an object keeps in its attributes (a LoRA method's base method too)."""
    for name, value in vars(obj).items():
        if isinstance(value, torch.Tensor):
            yield f"{where}.{name}", value
        elif name == "base":  # the method a LoraLinearMethod wraps
            yield from _held(value, f"{where}.base")


def _off_device(model: LlamaForCausalLM) -> list[str]:
    tensors = [*model.named_parameters(), *model.named_buffers()]
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            tensors += _held(module.method, f"{name}.method")
    return [f"{name} on {t.device}" for name, t in tensors if t.device != META]


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize(
    "model",
    [
        "float",
        "gguf Q8_0 tied",
        "gguf Q4_1",
        "gguf Q4_K+Q6_K",
        "int8 compressed-tensors",
        "--quantization int8",
    ],
)
def test_every_weight_and_lora_slot_is_on_the_models_device(
    models: dict[str, tuple[Path, str, str]], model: str, kernel: str
) -> None:
    path, quantization, storage = models[model]
    loaded = _load(path, KERNELS[kernel], quantization)
    if kernel != "torch":  # (the torch reference dequantizes GGUF blocks to float)
        assert quantization_of(loaded) == storage
        if model.startswith("gguf"):  # the LM head's blocks too (a tied one: the embedding's)
            assert loaded.lm_head.method.storage.startswith("gguf:")
    assert _off_device(loaded) == []
    # the LoRA kernel beside those linears (lora_kernel's choice, without building lora.c)
    lora_kernel = KERNELS[kernel].quantized_kernel
    enable_lora(loaded, max_loras=2, max_rank=4, max_tokens=8, kernel=lora_kernel)
    assert _off_device(loaded) == []
    lora = [m.method for m in loaded.modules() if isinstance(m, Linear)]
    assert sum(repr(m).startswith("LoRA(") for m in lora) == 4 * loaded.config.num_layers
