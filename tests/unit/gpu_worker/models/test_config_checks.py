"""Config fields that change a served family's outputs: read as transformers reads them, or
refused at start by name."""

from __future__ import annotations

from typing import Any

import pytest

from gpu_worker.models.config_checks import layer_windows
from gpu_worker.models.llama_config import LlamaConfig

BASE: dict[str, Any] = dict(
    vocab_size=10,
    hidden_size=8,
    intermediate_size=16,
    num_hidden_layers=4,
    num_attention_heads=2,
    max_position_embeddings=64,
)


def _hf_windows(model_type: str, **fields: Any) -> tuple[int, ...]:
    """Each layer's window in transformers' own config class, 0 for a full-attention one."""
    import transformers

    cls = {
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "smollm3": transformers.SmolLM3Config,
    }[model_type]
    hf = cls(**BASE, **fields)
    kinds = getattr(hf, "layer_types", None) or ["sliding_attention"] * hf.num_hidden_layers
    return tuple(
        hf.sliding_window if k == "sliding_attention" and hf.sliding_window else 0 for k in kinds
    )


@pytest.mark.parametrize(
    ("model_type", "fields"),
    [
        ("mistral", dict(sliding_window=16)),
        ("mistral", dict(sliding_window=None)),
        ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=2)),
        ("qwen2", dict(use_sliding_window=False, sliding_window=8, max_window_layers=2)),
        ("qwen3", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
        ("qwen3", dict(use_sliding_window=True, sliding_window=8, max_window_layers=9)),
        ("smollm3", dict(use_sliding_window=True, sliding_window=8, no_rope_layer_interval=2)),
        ("smollm3", dict(use_sliding_window=False, sliding_window=8)),
        (
            "qwen2",
            dict(
                use_sliding_window=True,
                sliding_window=8,
                layer_types=["full_attention", "sliding_attention"] * 2,
            ),
        ),
    ],
)
def test_layer_windows_follow_transformers(model_type: str, fields: dict[str, Any]) -> None:
    cfg = dict(BASE, model_type=model_type, **fields)
    assert layer_windows(cfg, model_type, 4) == _hf_windows(model_type, **fields)


def test_llama_ignores_window_fields_as_transformers_does() -> None:
    cfg = dict(BASE, model_type="llama", sliding_window=4, use_sliding_window=True)
    assert layer_windows(cfg, "llama", 4) == (0, 0, 0, 0)


def test_unimplemented_activation_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        LlamaConfig.from_hf(dict(BASE, model_type="llama", hidden_act="gelu"))


def test_bad_window_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="sliding_window must be"):
        LlamaConfig.from_hf(dict(BASE, model_type="mistral", sliding_window=0))
    with pytest.raises(ValueError, match="layer_types"):
        cfg = dict(BASE, model_type="qwen2", use_sliding_window=True, sliding_window=4)
        LlamaConfig.from_hf(dict(cfg, layer_types=["chunked_attention"] * 4))


def test_biases_follow_each_family() -> None:
    """transformers' Mistral has no biases and Qwen2 no o_proj bias, whatever the config."""
    mistral = LlamaConfig.from_hf(dict(BASE, model_type="mistral", attention_bias=True))
    assert not (mistral.qkv_bias or mistral.o_bias)
    qwen2 = LlamaConfig.from_hf(dict(BASE, model_type="qwen2", attention_bias=True))
    assert qwen2.qkv_bias and not qwen2.o_bias
    qwen3 = LlamaConfig.from_hf(dict(BASE, model_type="qwen3", attention_bias=True))
    assert qwen3.qkv_bias and qwen3.o_bias


def test_windows_reach_the_config_per_layer() -> None:
    cfg = dict(BASE, model_type="qwen2", use_sliding_window=True, sliding_window=8)
    windows = LlamaConfig.from_hf(dict(cfg, max_window_layers=3))
    assert [windows.sliding_window(i) for i in range(4)] == [0, 0, 0, 8]
    assert LlamaConfig.from_hf(dict(cfg, max_window_layers=4)).sliding_windows == ()


def test_phi3_reads_its_window_and_splits_over_ranks() -> None:
    from gpu_worker.model_loader.loader import check_tensor_parallel, fused_parts

    cfg = LlamaConfig.from_hf(dict(BASE, model_type="phi3", sliding_window=15))
    assert cfg.sliding_windows == (15,) * 4 and not (cfg.qkv_bias or cfg.mlp_bias)
    check_tensor_parallel(cfg, 1)
    check_tensor_parallel(cfg, 2)  # its fused qkv_proj / gate_up_proj split part by part
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    assert fused_parts(cfg) == {"qkv_proj": (q, kv, kv), "gate_up_proj": (16, 16)}


GEMMA3_LEGACY: dict[str, Any] = dict(
    BASE,
    model_type="gemma3_text",
    num_hidden_layers=12,
    head_dim=32,
    query_pre_attn_scalar=256,
    sliding_window=512,
    sliding_window_pattern=6,
    rope_theta=1_000_000.0,
    rope_local_base_freq=10_000.0,
    rope_scaling=dict(rope_type="linear", factor=8.0),
    final_logit_softcapping=None,
    attn_logit_softcapping=None,
)


def test_gemma3_legacy_config_reads_as_transformers_does() -> None:
    """An older Gemma 3 config.json: 5 local : 1 global by sliding_window_pattern, the
    global rope with rope_scaling, the local one by rope_local_base_freq."""
    import transformers

    cfg = LlamaConfig.from_hf(GEMMA3_LEGACY)
    hf = transformers.Gemma3TextConfig(
        **{k: v for k, v in GEMMA3_LEGACY.items() if k != "model_type"}
    )
    assert [cfg.sliding_window(i) > 0 for i in range(12)] == [
        k == "sliding_attention" for k in hf.layer_types
    ]
    assert (cfg.rope_theta, cfg.rope_scaling) == (
        1e6,
        dict(rope_type="linear", factor=8.0, rope_theta=1e6),
    )
    assert (cfg.local_rope_theta, cfg.local_rope_scaling) == (1e4, None)
    assert cfg.attn_scale == 256**-0.5 and not (cfg.attn_softcap or cfg.final_softcap)
    assert cfg.norm_offset == 1.0 and cfg.qk_norm and not cfg.is_llama_layout


def test_gemma_unserved_settings_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="hidden_activation 'gelu'"):
        LlamaConfig.from_hf(dict(GEMMA3_LEGACY, hidden_activation="gelu"))
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        LlamaConfig.from_hf(dict(GEMMA3_LEGACY, use_bidirectional_attention=True))


def test_smollm3_no_rope_layers_as_transformers_reads_them() -> None:
    import transformers

    cfg = LlamaConfig.from_hf(dict(BASE, model_type="smollm3"))
    hf = transformers.SmolLM3Config(**BASE)
    assert [cfg.uses_rope(i) for i in range(4)] == [bool(f) for f in hf.no_rope_layers]
    assert not cfg.is_llama_layout  # the one-call step rotates every layer
    every = LlamaConfig.from_hf(dict(BASE, model_type="smollm3", no_rope_layers=[1, 1, 1, 1]))
    assert every.rope_layers == () and every.is_llama_layout
