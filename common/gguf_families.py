"""What a GGUF file says about a family beyond the Llama keys, as config.json fields.

common/gguf_meta.read_gguf_config reads the keys every family shares; this module adds a
family's own, as llama.cpp reads them (its llama-model.cpp; its convert_hf_to_gguf.py writes
them), and llama.cpp's fixed choices where the file holds no key:

    family    key (under "<arch>.")              config.json field        absent: llama.cpp's
    gemma2    attention.sliding_window           sliding_window           4096
              attn_logit_softcapping             attn_logit_softcapping   50
              final_logit_softcapping            final_logit_softcapping  30
              attention.sliding_window_pattern   layer_types              2 (even layers slide)
    gemma3    attention.sliding_window           sliding_window           none
              final_logit_softcapping            final_logit_softcapping  none
              attention.sliding_window_pattern   layer_types              6 (5 local : 1 global)
              rope.freq_base (+ rope.scaling)    the full layers' rope    1e6
              rope.freq_base_swa                 the sliding layers' rope 1e4, unscaled
    both      (none)                             query_pre_attn_scalar    hidden / heads for the
                                                                          27B (by layer count),
                                                                          else head_dim
    smollm3   (none)                             no_rope_layer_interval   4 (every 4th: no rope)
    mistral   attention.sliding_window           sliding_window           none
    phi3      attention.sliding_window           sliding_window           none
              rope.dimension_count (< head_dim)  partial_rotary_factor    1 (Phi-4-mini: 96 of 128)
              rope_factors_long/short tensors    longrope's long/short    plain rope
              rope.scaling.original_context_length  its original length   (required with them)
              rope.scaling.attn_factor           attention_factor         sqrt(1 + ln(s)/ln(orig))

llama.cpp's converter writes no window for a Mistral (a "llama" file): such a file attends to
its whole context, as llama.cpp runs it; a file with the key gets the window on every layer.
Gemma's RMSNorm weights are stored with Gemma's +1 added (gpu_worker/model_loader/gguf_file.py
takes it off again).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

GEMMA_ARCHITECTURES = frozenset({"gemma2", "gemma3"})
# llama.cpp's 27B of each Gemma, told apart by its layer count: its attention scale is
# 1 / sqrt(hidden / heads) (query_pre_attn_scalar 144 and 168), every other size's
# 1 / sqrt(head_dim)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_GEMMA_PATTERN = {"gemma2": 2, "gemma3": 6}
_GEMMA_SOFTCAPS = {"gemma2": (50.0, 30.0), "gemma3": (None, None)}
_GEMMA_WINDOW = {"gemma2": 4096, "gemma3": None}

Value = Callable[[str, Any], Any]  # (key under "<arch>.", default) -> the file's value


def family_config(arch: str, model_type: str, value: Value, base: dict[str, Any]) -> dict[str, Any]:
    """The config.json fields the file's family adds to (or changes in) `base`, the Llama
    fields read_gguf_config has read."""
    if arch in GEMMA_ARCHITECTURES:
        return _gemma_config(arch, value, base)
    if arch == "smollm3":
        return {"no_rope_layer_interval": 4, "use_sliding_window": False}
    if model_type in ("mistral", "phi3"):
        window = value("attention.sliding_window", None)
        return {"sliding_window": int(window) if window else None}
    return {}


def phi3_rope_config(
    value: Value, base: dict[str, Any], factors: dict[str, list[float]] | None
) -> dict[str, Any]:
    """A phi3 file's rope as config.json has it: a rope.dimension_count below head_dim is
    its partial_rotary_factor; `factors` (its rope_factors_short/long tensors, None if it
    has none) make it LongRoPE over rope.scaling.original_context_length, scaled by
    rope.scaling.attn_factor where that is not the default (read back from float32)."""
    head_dim = base["head_dim"]
    rope = dict(base["rope_parameters"])
    rotary_dims = int(value("rope.dimension_count", head_dim))
    if rotary_dims != head_dim:
        rope["partial_rotary_factor"] = rotary_dims / head_dim
    config: dict[str, Any] = {"rope_parameters": rope}
    if factors is None:
        return config
    original = value("rope.scaling.original_context_length", None)
    if original is None:
        raise ValueError("phi3.rope.scaling.original_context_length is missing (longrope)")
    rope.update(rope_type="longrope", **factors)
    config["original_max_position_embeddings"] = int(original)
    scale = base["max_position_embeddings"] / int(original)
    default = math.sqrt(1 + math.log(scale) / math.log(int(original))) if scale > 1 else 1.0
    attn = value("rope.scaling.attn_factor", None)
    if attn is not None and np.float32(attn) != np.float32(default):
        rope["attention_factor"] = float(attn)
    return config


def _gemma_config(arch: str, value: Value, base: dict[str, Any]) -> dict[str, Any]:
    layers, heads = base["num_hidden_layers"], base["num_attention_heads"]
    pattern = value("attention.sliding_window_pattern", _GEMMA_PATTERN[arch])
    if isinstance(pattern, list):  # one flag per layer
        slides = [bool(p) for p in pattern]
    else:  # llama.cpp's set_swa_pattern(n): every n-th layer is global
        slides = [(i + 1) % int(pattern) != 0 for i in range(layers)]
    if len(slides) != layers:
        raise ValueError(f"{arch}.attention.sliding_window_pattern has {len(slides)} of {layers}")
    window = value("attention.sliding_window", _GEMMA_WINDOW[arch])
    attn_cap, final_cap = _GEMMA_SOFTCAPS[arch]
    is_27b = layers == _GEMMA_27B_LAYERS[arch]
    config: dict[str, Any] = {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": int(window) if window else None,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in slides],
        "query_pre_attn_scalar": base["hidden_size"] // heads if is_27b else base["head_dim"],
        "attn_logit_softcapping": value("attn_logit_softcapping", attn_cap),
        "final_logit_softcapping": value("final_logit_softcapping", final_cap),
    }
    if arch == "gemma3":  # the global layers' rope (scaled) and the local layers' own
        local = float(value("rope.freq_base_swa", 10_000.0))
        config["rope_parameters"] = {
            "full_attention": dict(base["rope_parameters"]),
            "sliding_attention": {"rope_type": "default", "rope_theta": local},
        }
    return config
