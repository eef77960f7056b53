"""RoPE scalings against transformers' own: the same inverse frequencies and cos/sin tables,
bit for bit; the scalings that depend on the forward call refused by name."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gpu_worker.models.llama import LlamaConfig, RotaryEmbedding

BASE: dict[str, Any] = dict(
    model_type="llama",
    vocab_size=10,
    hidden_size=128,
    intermediate_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
    max_position_embeddings=512,
)
SCALINGS = {
    "default": dict(rope_type="default", rope_theta=10000.0),
    "linear": dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
    "yarn": dict(
        rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=128
    ),
    "yarn-mscale": dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=40.0,
        original_max_position_embeddings=64,
        mscale=0.707,
        mscale_all_dim=0.707,
        beta_fast=32,
        beta_slow=1,
    ),
    "yarn-no-truncate": dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=8.0,
        original_max_position_embeddings=64,
        truncate=False,
        attention_factor=1.25,
    ),
    "llama3": dict(
        rope_type="llama3",
        rope_theta=5e5,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
    ),
}


def _hf_tables(cfg: dict[str, Any], positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Llama rotary embedding: cos and sin of the first half (they repeat)."""
    import transformers
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_cfg = transformers.LlamaConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    rotary = LlamaRotaryEmbedding(hf_cfg)
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = rotary(x, positions[None])
    half = cos.shape[-1] // 2
    return cos[0, :, :half], sin[0, :, :half]


@pytest.mark.parametrize("name", SCALINGS)
def test_tables_equal_transformers(name: str) -> None:
    cfg = dict(BASE, rope_parameters=dict(SCALINGS[name]))
    ours = LlamaConfig.from_hf(cfg)
    rotary = RotaryEmbedding(
        ours.head_dim, 512, ours.rope_theta, ours.rope_scaling, torch.device("cpu")
    )
    positions = torch.arange(512)
    cos, sin = rotary.tables()
    hf_cos, hf_sin = _hf_tables(cfg, positions)
    assert torch.equal(cos, hf_cos) and torch.equal(sin, hf_sin)


def test_legacy_rope_scaling_with_top_level_original_length() -> None:
    """Older configs: rope_scaling {"type": ...}; original_max_position_embeddings at the top
    level wins, as in transformers' standardize_rope_params."""
    cfg = dict(
        BASE,
        rope_theta=10000.0,
        original_max_position_embeddings=32,
        rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=128),
    )
    scaling = LlamaConfig.from_hf(cfg).rope_scaling
    assert scaling is not None and scaling["original_max_position_embeddings"] == 32


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_per_call_scalings_are_refused_by_name(rope_type: str) -> None:
    params = dict(rope_type=rope_type, factor=2.0, short_factor=[1.0], long_factor=[2.0])
    with pytest.raises(ValueError, match=f"rope_type '{rope_type}' is not supported: "):
        LlamaConfig.from_hf(dict(BASE, rope_parameters=params))


def test_unknown_scaling_and_partial_rotary_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="rope_type 'su' is not supported"):
        LlamaConfig.from_hf(dict(BASE, rope_parameters=dict(rope_type="su", factor=2.0)))
    with pytest.raises(ValueError, match="factor is missing"):
        LlamaConfig.from_hf(dict(BASE, rope_parameters=dict(rope_type="yarn")))
    with pytest.raises(ValueError, match="partial_rotary_factor 0.5"):
        LlamaConfig.from_hf(dict(BASE, partial_rotary_factor=0.5))
