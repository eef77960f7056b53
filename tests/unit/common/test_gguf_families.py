"""common/gguf_families.py: each family's GGUF keys as config.json fields, and llama.cpp's
fixed choices where a file has no key."""

from __future__ import annotations

from typing import Any

import pytest

from common.gguf_families import family_config

BASE = dict(
    num_hidden_layers=6,
    num_attention_heads=8,
    hidden_size=1024,
    head_dim=256,
    rope_parameters={"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
)


def _values(keys: dict[str, Any]):  # type: ignore[no-untyped-def]
    return lambda key, default: keys.get(key, default)


def test_gemma2_defaults_are_llama_cpps() -> None:
    config = family_config("gemma2", "gemma2", _values({}), dict(BASE, num_hidden_layers=4))
    assert config["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert config["sliding_window"] == 4096
    assert (config["attn_logit_softcapping"], config["final_logit_softcapping"]) == (50.0, 30.0)
    assert config["query_pre_attn_scalar"] == 256  # head_dim


@pytest.mark.parametrize(("arch", "layers"), [("gemma2", 46), ("gemma3", 62)])
def test_a_27b_gemma_scales_queries_by_hidden_over_heads(arch: str, layers: int) -> None:
    config = family_config(arch, arch, _values({}), dict(BASE, num_hidden_layers=layers))
    assert config["query_pre_attn_scalar"] == 1024 // 8


def test_gemma3_pattern_window_and_two_ropes() -> None:
    keys = {"attention.sliding_window": 512, "rope.freq_base_swa": 20_000.0}
    config = family_config("gemma3", "gemma3_text", _values(keys), dict(BASE, num_hidden_layers=12))
    assert config["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 2
    assert config["sliding_window"] == 512
    assert config["attn_logit_softcapping"] is None
    assert config["rope_parameters"] == {
        "full_attention": BASE["rope_parameters"],
        "sliding_attention": {"rope_type": "default", "rope_theta": 20_000.0},
    }


def test_a_per_layer_pattern_and_a_wrong_length() -> None:
    flags = {"attention.sliding_window_pattern": [True, False, False, True, True, False]}
    config = family_config("gemma3", "gemma3_text", _values(flags), BASE)
    assert config["layer_types"][:3] == ["sliding_attention", "full_attention", "full_attention"]
    short = {"attention.sliding_window_pattern": [True, False]}
    with pytest.raises(ValueError, match="sliding_window_pattern has 2 of 6"):
        family_config("gemma3", "gemma3_text", _values(short), BASE)


def test_smollm3_and_mistral() -> None:
    assert family_config("smollm3", "smollm3", _values({}), BASE)["no_rope_layer_interval"] == 4
    window = {"attention.sliding_window": 4096}
    assert family_config("llama", "mistral", _values(window), BASE) == {"sliding_window": 4096}
    assert family_config("llama", "mistral", _values({}), BASE) == {"sliding_window": None}
    assert family_config("llama", "llama", _values(window), BASE) == {}
