"""RoPE scalings against transformers' own: the same inverse frequencies and cos/sin tables,
bit for bit; longrope's factors chosen by the served context (gpu_worker/models/rope.py);
partial rotary only where transformers' modeling rotates part of a head; unknown types
refused by name."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gpu_worker.models.llama import RotaryEmbedding
from gpu_worker.models.llama_config import LlamaConfig

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
    "dynamic": dict(rope_type="dynamic", rope_theta=10000.0, factor=1.3),
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


PHI3: dict[str, Any] = dict(
    BASE,
    model_type="phi3",
    hidden_size=64,
    num_attention_heads=4,
    max_position_embeddings=256,
    original_max_position_embeddings=64,
)


def _longrope(partial: float) -> dict[str, Any]:
    pairs = int(16 * partial) // 2
    return dict(
        PHI3,
        partial_rotary_factor=partial,
        rope_scaling=dict(
            type="longrope",
            short_factor=[1.0 + 0.1 * i for i in range(pairs)],
            long_factor=[1.0 + 3.0 * i for i in range(pairs)],
        ),
    )


def _hf_phi3_tables(
    cfg: dict[str, Any], positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Phi-3 rotary embedding for one forward of `positions`."""
    import transformers
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    hf_cfg = transformers.Phi3Config(**{k: v for k, v in cfg.items() if k != "model_type"})
    cos, sin = Phi3RotaryEmbedding(hf_cfg)(torch.zeros(1), positions[None])
    half = cos.shape[-1] // 2
    return cos[0, :, :half], sin[0, :, :half]


@pytest.mark.parametrize("partial", [1.0, 0.75])
@pytest.mark.parametrize("served", [64, 256])
def test_longrope_tables_are_transformers_for_a_call_as_long_as_the_served_context(
    partial: float, served: int
) -> None:
    """A served context within the original: the short factors, as transformers for every call
    within it; past it: the long ones, as transformers for a call that passes it. Both scaled
    by sqrt(1 + ln(256 / 64) / ln(64)); Phi-4-mini's 0.75 rotates 12 of 16 dims."""
    cfg = _longrope(partial)
    ours = LlamaConfig.from_hf(cfg)
    assert ours.rotary_dim == int(16 * partial)
    rotary = RotaryEmbedding(
        ours.rotary_dim, served, ours.rope_theta, ours.rope_scaling, torch.device("cpu")
    )
    cos, sin = rotary.tables()
    hf_cos, hf_sin = _hf_phi3_tables(cfg, torch.arange(served))
    assert cos.shape == (served, ours.rotary_dim // 2)
    assert torch.equal(cos, hf_cos) and torch.equal(sin, hf_sin)


def test_longrope_factor_and_attention_factor_as_given() -> None:
    cfg = _longrope(1.0)
    cfg["rope_scaling"] = dict(cfg["rope_scaling"], factor=8.0, attention_factor=1.5)
    scaling = LlamaConfig.from_hf(cfg).rope_scaling
    assert scaling is not None and (scaling["factor"], scaling["attention_factor"]) == (8.0, 1.5)
    cfg["rope_scaling"]["short_factor"] = [1.0, 2.0]
    with pytest.raises(ValueError, match="short_factor has 2 values, not 8"):
        RotaryEmbedding(16, 64, 1e4, LlamaConfig.from_hf(cfg).rope_scaling, torch.device("cpu"))


def test_phi3_legacy_su_and_yarn_names_are_longrope() -> None:
    for name in ("su", "yarn"):
        cfg = _longrope(1.0)
        cfg["rope_scaling"] = dict(cfg["rope_scaling"], type=name)
        scaling = LlamaConfig.from_hf(cfg).rope_scaling
        assert scaling is not None and scaling["rope_type"] == "longrope"


def test_dynamic_is_plain_up_to_max_position_embeddings_and_refused_past_it() -> None:
    cfg = dict(BASE, rope_parameters=dict(SCALINGS["dynamic"]))
    scaling = LlamaConfig.from_hf(cfg).rope_scaling
    with pytest.raises(ValueError, match="'dynamic' is served up to 512 positions"):
        RotaryEmbedding(64, 513, 10000.0, scaling, torch.device("cpu"))


def test_unknown_scaling_and_partial_rotary_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="rope_type 'su' is not supported"):
        LlamaConfig.from_hf(dict(BASE, rope_parameters=dict(rope_type="su", factor=2.0)))
    with pytest.raises(ValueError, match="factor is missing"):
        LlamaConfig.from_hf(dict(BASE, rope_parameters=dict(rope_type="yarn")))
    with pytest.raises(ValueError, match="short_factor .a list. is missing"):
        LlamaConfig.from_hf(dict(BASE, rope_parameters=dict(rope_type="longrope")))
    with pytest.raises(ValueError, match="partial_rotary_factor 0.5 is not supported for 'llama'"):
        LlamaConfig.from_hf(dict(BASE, partial_rotary_factor=0.5))
    with pytest.raises(ValueError, match="gives 3 rotary dims"):
        LlamaConfig.from_hf(dict(PHI3, partial_rotary_factor=0.1875))
