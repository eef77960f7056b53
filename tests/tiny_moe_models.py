"""Tiny randomly initialised mixture-of-experts models, saved as Hugging Face folders for
tests (tests/tiny_models.py's conventions: SmolLM2's vocabulary and tokenizer, hidden 64,
deterministic). Real config fields, shrunk sizes, chosen to cover each family's routing:

    qwen3_moe  8 experts of 32, top-2 renormalised (norm_topk_prob), per-head q/k norms,
               3 layers with layer 1 dense (mlp_only_layers)
    qwen2_moe  8 experts of 32, top-4 not renormalised, a shared expert of 96 with its
               sigmoid gate, q/k/v biases, 3 layers of which layer 1 is sparse
               (decoder_sparse_step 2)
    mixtral    4 experts of 96, top-2 (always renormalised, weights kept in float32)
    olmoe      8 experts of 32, top-2, q/k RMSNorm over the whole projections
    gpt_oss    gpt-oss-20b's config shrunk (GPT_OSS_20B below): 8 experts of 64, top-4
               (top-k logits then softmax, router bias), clamped SwiGLU (limit 7) with
               experts' biases, q/k/v/o biases, a sink logit per head, 4 layers alternating
               sliding (16) and full, YaRN rope (factor 32 over an original 32 positions)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.tiny_models import _COMMON, _copy_tokenizer, _perturb_norms_and_biases

MOE_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")

# openai/gpt-oss-20b's config.json (the fields that shape the model)
GPT_OSS_20B: dict[str, Any] = dict(
    hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8,
    head_dim=64, num_hidden_layers=24, num_local_experts=32, num_experts_per_tok=4,
    sliding_window=128, rope_theta=150000, swiglu_limit=7.0, rms_norm_eps=1e-5,
    max_position_embeddings=131072, attention_bias=True, tie_word_embeddings=False,
    rope_scaling=dict(
        rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
        original_max_position_embeddings=4096,
    ),
)  # fmt: skip


def gpt_oss_fields() -> dict[str, Any]:
    """GPT_OSS_20B shrunk to hidden 64: the heads' ratios (8 query heads per KV head, q
    wider than hidden), the window and original context as the same fractions of the
    positions served (1024), the same rope scaling, swiglu_limit and expert/top-k ratio."""
    big = GPT_OSS_20B
    scaling = dict(big["rope_scaling"], original_max_position_embeddings=32)
    return dict(
        hidden_size=64, intermediate_size=64, num_attention_heads=8, num_key_value_heads=1,
        head_dim=12, num_hidden_layers=4, num_local_experts=8, num_experts_per_tok=4,
        sliding_window=16, rope_theta=big["rope_theta"], swiglu_limit=big["swiglu_limit"],
        rms_norm_eps=big["rms_norm_eps"], max_position_embeddings=1024, attention_bias=True,
        tie_word_embeddings=False, rope_parameters=dict(scaling, rope_theta=big["rope_theta"]),
        layer_types=["sliding_attention", "full_attention"] * 2,
    )  # fmt: skip


def moe_config(arch: str, **overrides: Any) -> Any:
    """The transformers config of a tiny `arch` MoE (see the module docstring)."""
    import transformers

    common = dict(_COMMON, num_key_value_heads=2, tie_word_embeddings=False)
    if arch == "qwen3_moe":
        fields = dict(
            common, num_hidden_layers=3, head_dim=32, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1],
        )  # fmt: skip
        return transformers.Qwen3MoeConfig(**{**fields, **overrides})
    if arch == "qwen2_moe":
        fields = dict(
            common, num_hidden_layers=3, num_experts=8, num_experts_per_tok=4,
            moe_intermediate_size=32, norm_topk_prob=False, shared_expert_intermediate_size=96,
            decoder_sparse_step=2, use_sliding_window=False,
        )  # fmt: skip
        return transformers.Qwen2MoeConfig(**{**fields, **overrides})
    if arch == "mixtral":
        fields = dict(
            common, num_hidden_layers=2, intermediate_size=96, num_local_experts=4,
            num_experts_per_tok=2, sliding_window=None,
        )  # fmt: skip
        return transformers.MixtralConfig(**{**fields, **overrides})
    if arch == "olmoe":
        fields = dict(
            common, num_hidden_layers=2, intermediate_size=32, num_experts=8,
            num_experts_per_tok=2, norm_topk_prob=False,
        )  # fmt: skip
        return transformers.OlmoeConfig(**{**fields, **overrides})
    if arch == "gpt_oss":
        fields = dict(_COMMON, **gpt_oss_fields())
        return transformers.GptOssConfig(**{**fields, **overrides})
    raise ValueError(f"unknown tiny MoE arch {arch!r}; known: {MOE_ARCHS}")


def make_tiny_moe_model(folder: str | Path, arch: str, *, seed: int = 0, **overrides: Any) -> Path:
    """Create (or reuse, if complete) a tiny `arch` MoE model in `folder`; returns it."""
    import transformers

    folder = Path(folder)
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return folder
    config = moe_config(arch, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb_norms_and_biases(model)
    with torch.no_grad():  # gpt-oss: sinks large enough to take a share of each softmax
        for name, param in model.named_parameters():
            if name.endswith(".sinks"):
                param.copy_(torch.randn_like(param))
    model.save_pretrained(folder)
    _copy_tokenizer(folder)
    return folder


def make_tiny_mxfp4_gpt_oss(
    folder: str | Path, seed: int = 0, **overrides: Any
) -> tuple[Path, Path]:
    """A tiny gpt-oss in the shipped layout: its experts' gate/up and down as MXFP4
    (`*_blocks` uint8 [E, out, in / 32, 16] of random E2M1 nibbles, `*_scales` uint8
    [E, out, in / 32] of random E8M0 exponents 2 ** -5 .. 2 ** -3), everything else float,
    config.json with quantization_config {"quant_method": "mxfp4", ...} as gpt-oss-20b's.
    Returns (that folder, a float folder of the same model with the experts dequantized:
    what transformers computes on). `overrides` change the config as make_tiny_moe_model's."""
    import json

    from safetensors.torch import load_file, save_file

    from gpu_worker.layers.moe_methods.mxfp4 import dequantize_mxfp4

    folder = Path(folder)
    packed, dense = folder / "mxfp4", folder / "dequantized"
    if (packed / "config.json").is_file() and (dense / "config.json").is_file():
        return packed, dense
    base = make_tiny_moe_model(folder / "float", "gpt_oss", seed=seed, **overrides)
    gen = torch.Generator().manual_seed(seed + 1)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(base.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    quantized = dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, n_in, n_out = tensors[name].shape  # x @ W: [E, in, out]
        blocks = torch.randint(0, 256, (experts, n_out, n_in // 32, 16), generator=gen)
        scales = torch.randint(122, 125, (experts, n_out, n_in // 32), generator=gen)
        blocks, scales = blocks.to(torch.uint8), scales.to(torch.uint8)
        del quantized[name]
        quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
        tensors[name] = dequantize_mxfp4(blocks, scales).transpose(1, 2).contiguous()
    config = json.loads((base / "config.json").read_text())
    for out, weights, cfg in (
        (dense, tensors, config),
        (packed, quantized, dict(config, quantization_config=_MXFP4_CONFIG)),
    ):
        out.mkdir(parents=True, exist_ok=True)
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
        _copy_tokenizer(out)
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return packed, dense


# gpt-oss-20b's quantization_config
_MXFP4_CONFIG = {
    "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head",
    ],
    "quant_method": "mxfp4",
}  # fmt: skip
