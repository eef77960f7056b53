"""Tiny randomly initialised Llama-family models, saved as Hugging Face folders for tests.

Each is a few MB (hidden 64, 2 layers) with SmolLM2's vocabulary size, and SmolLM2's tokenizer
files copied in when the default model folder exists, so a tiny model can also be served end
to end. Creation is deterministic (torch.manual_seed). The shapes vary on purpose:

    llama    4 heads / 2 KV heads, untied LM head, llama3 rope scaling
    qwen2    4 heads / 1 KV head, q/k/v biases, untied
    qwen3    4 heads / 2 KV heads, head_dim 32 != hidden / heads, q/k norms, tied embeddings
    mistral  4 heads / 4 KV heads (no GQA), tied embeddings
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from gpu_worker.prepare_model import default_model_dir

TINY_ARCHS = ("llama", "qwen2", "qwen3", "mistral")
VOCAB_SIZE = 49152  # SmolLM2's tokenizer
EOS_TOKEN_ID = 2  # "<|im_end|>" in SmolLM2's tokenizer
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=160,
    num_attention_heads=4,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    # larger than HF's 0.02 so a random model's logits are not all near-ties
    initializer_range=0.08,
    bos_token_id=1,
    eos_token_id=EOS_TOKEN_ID,
    pad_token_id=EOS_TOKEN_ID,
)


def _config(arch: str, num_layers: int, vocab_size: int = VOCAB_SIZE) -> Any:
    import transformers

    common = dict(_COMMON, num_hidden_layers=num_layers, vocab_size=vocab_size)
    if arch == "llama":
        llama3 = dict(
            rope_type="llama3",
            rope_theta=10000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        )
        return transformers.LlamaConfig(
            **common, num_key_value_heads=2, rope_parameters=llama3, tie_word_embeddings=False
        )
    if arch == "qwen2":
        return transformers.Qwen2Config(
            **common, num_key_value_heads=1, tie_word_embeddings=False, use_sliding_window=False
        )
    if arch == "qwen3":
        return transformers.Qwen3Config(
            **common, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True
        )
    if arch == "mistral":
        return transformers.MistralConfig(
            **common, num_key_value_heads=4, sliding_window=None, tie_word_embeddings=True
        )
    raise ValueError(f"unknown tiny arch {arch!r}; known: {TINY_ARCHS}")


def _perturb_norms_and_biases(model: torch.nn.Module) -> None:
    """HF initialises norms to 1 and biases to 0; random values make loading bugs visible."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn_like(param))


def make_tiny_model(
    folder: str | Path, arch: str = "llama", *, num_layers: int = 2, seed: int = 0,
    vocab_size: int = VOCAB_SIZE,
) -> Path:
    """Create (or reuse, if complete) a tiny `arch` model in `folder`; returns the folder.
    With another `vocab_size` (a few tokens, for statistical tests) it has no tokenizer."""
    import transformers

    folder = Path(folder)
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return folder
    config = _config(arch, num_layers, vocab_size)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb_norms_and_biases(model)
    model.save_pretrained(folder)
    if vocab_size == VOCAB_SIZE:
        _copy_tokenizer(folder)
    return folder


def _copy_tokenizer(folder: Path) -> None:
    source = default_model_dir()
    for name in _TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)
