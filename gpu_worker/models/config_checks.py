"""The config.json fields that change a served family's outputs, read or refused by name.

transformers reads a few fields per family beyond the shapes (its modeling_<family>.py):

    field                       families              here
    hidden_act                  all                   "silu" only (SwiGLU)
    sliding_window              mistral, phi3         read: every layer's window
    use_sliding_window,         qwen2, qwen3,         read: the window of the layers
      sliding_window,           smollm3               layer_types (or max_window_layers;
      max_window_layers,                              smollm3: the no-rope layers) names
      layer_types                                     "sliding_attention"
    no_rope_layers              smollm3               read: 0 marks a layer without rope
                                                      (default: every no_rope_layer_interval-th)
    attention_bias              llama, qwen3,         q/k/v/o biases (qwen2: q/k/v always;
                                smollm3, gpt_oss      mistral, phi3: none; gpt_oss: default on)
    sliding_window,             gpt_oss               read: the window of the layers
      layer_types                                     "sliding_attention" (default: even ones)
    mlp_bias                    llama, smollm3        gate/up/down biases

A field transformers reads for the family and we do not implement is refused at start with
its name, never ignored: an ignored field gives other tokens than the model's own.
"""

from __future__ import annotations

from typing import Any

# the activation names transformers maps to SiLU
_SILU_NAMES = ("silu", "swish")


def check_activation(cfg: dict[str, Any]) -> None:
    """Refuse an MLP activation other than SiLU (the MLP is SwiGLU)."""
    act = cfg.get("hidden_act", "silu")
    if act not in _SILU_NAMES:
        raise ValueError(f"hidden_act {act!r} is not supported ({', '.join(_SILU_NAMES)})")


def layer_windows(cfg: dict[str, Any], model_type: str, num_layers: int) -> tuple[int, ...]:
    """Each layer's sliding window as transformers applies it for `model_type` (a key at
    position j is visible to a query at position i when i - window < j <= i), 0 for a layer
    that attends to its whole context."""
    window = cfg.get("sliding_window")
    if model_type in _USE_SLIDING and not cfg.get("use_sliding_window", False):
        window = None  # transformers drops the window unless use_sliding_window
    if model_type not in ("mistral", "phi3", "gpt_oss", *_USE_SLIDING) or window is None:
        return (0,) * num_layers
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"sliding_window must be a positive integer, got {window!r}")
    if model_type in ("mistral", "phi3"):
        return (window,) * num_layers
    kinds = cfg.get("layer_types")
    if kinds is None and model_type == "gpt_oss":  # transformers' default: even layers slide
        kinds = [_KINDS[i % 2] for i in range(num_layers)]
    if kinds is None and model_type == "smollm3":  # transformers' default: no-rope layers slide
        kinds = ["full_attention" if r else "sliding_attention" for r in rope_layers(cfg)]
    if kinds is None:  # transformers' default: layers from max_window_layers on slide
        first = cfg.get("max_window_layers", 28)
        kinds = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if len(kinds) != num_layers:
        raise ValueError(f"layer_types has {len(kinds)} entries for {num_layers} layers")
    for kind in kinds:
        if kind not in ("sliding_attention", "full_attention"):
            raise ValueError(f"layer_types entry {kind!r} is not supported")
    return tuple(window if kind == "sliding_attention" else 0 for kind in kinds)


_USE_SLIDING = ("qwen2", "qwen3", "smollm3")


def rope_layers(cfg: dict[str, Any]) -> tuple[bool, ...]:
    """SmolLM3's layers that rotate q and k (no_rope_layers: 1 rotates, 0 does not; by default
    every no_rope_layer_interval-th layer does not), as transformers reads them."""
    num_layers = cfg["num_hidden_layers"]
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = cfg.get("no_rope_layer_interval", 4)
        flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if len(flags) != num_layers:
        raise ValueError(f"no_rope_layers has {len(flags)} entries for {num_layers} layers")
    return tuple(bool(f) for f in flags)


# --- Gemma 2 and Gemma 3 (text) ---------------------------------------------------------
# What they change against the Llama layer (transformers' modeling_gemma2 / modeling_gemma3):
#
#   embeddings * sqrt(hidden_size);  every RMSNorm * (1 + weight);  GeGLU (gelu tanh)
#   x += post_attention_norm(attn(input_norm(x)));  x += post_ffw_norm(mlp(pre_ffw_norm(x)))
#   scores * query_pre_attn_scalar ** -0.5, soft-capped (Gemma 2: attn_logit_softcapping)
#   logits soft-capped (final_logit_softcapping);  sliding layers by layer_types
#   Gemma 3: q/k norms (+1 too); its sliding layers rotate by their own rope (local base)

GEMMA_TYPES = ("gemma2", "gemma3_text")
_GELU_TANH = ("gelu_pytorch_tanh",)


def gemma_layer_types(cfg: dict[str, Any], model_type: str, num_layers: int) -> list[str]:
    """transformers' default: Gemma 2 alternates sliding and full from layer 0; Gemma 3
    makes every sliding_window_pattern-th layer full (5 local : 1 global)."""
    kinds = cfg.get("layer_types")
    if kinds is not None:
        return list(kinds)
    pattern = 2 if model_type == "gemma2" else cfg.get("sliding_window_pattern", 6)
    return [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)
    ]


def gemma_fields(cfg: dict[str, Any], model_type: str, num_layers: int) -> dict[str, Any]:
    """LlamaConfig's Gemma fields from a Gemma 2 / Gemma 3 text config.json; unserved
    settings refused by name."""
    act = cfg.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in _GELU_TANH:
        raise ValueError(f"hidden_activation {act!r} is not supported {_GELU_TANH}")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention is not supported (causal decoding only)")
    kinds = gemma_layer_types(cfg, model_type, num_layers)
    window = cfg.get("sliding_window")
    if len(kinds) != num_layers or any(k not in _KINDS for k in kinds):
        raise ValueError(f"layer_types {kinds!r} is not {num_layers} of {_KINDS}")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"sliding_window must be a positive integer, got {window!r}")
    windows = tuple(window if k == "sliding_attention" and window else 0 for k in kinds)
    return dict(
        sliding_windows=windows if any(windows) else (),
        norm_offset=1.0,
        sandwich_norms=True,
        gelu_tanh=True,
        embed_scale=float(cfg["hidden_size"]) ** 0.5,
        attn_scale=float(cfg.get("query_pre_attn_scalar") or cfg["head_dim"]) ** -0.5,
        attn_softcap=float(cfg.get("attn_logit_softcapping") or 0.0),
        final_softcap=float(cfg.get("final_logit_softcapping") or 0.0),
    )


_KINDS = ("sliding_attention", "full_attention")


def gemma3_ropes(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Gemma 3's two ropes as flat configs (rope_theta and rope_parameters each): the full
    layers' (rope_theta, default 1e6, with rope_scaling) and the sliding layers' (the local
    base, rope_local_base_freq, default 1e4) — nested per layer type in transformers 5's
    rope_parameters, top-level fields in older configs."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:
        full = dict(cfg.get("rope_scaling") or params or {})
        full.setdefault("rope_theta", cfg.get("rope_theta"))
        local = {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq")}
    full["rope_theta"] = full.get("rope_theta") or 1_000_000.0
    local["rope_theta"] = local.get("rope_theta") or 10_000.0
    base = {k: v for k, v in cfg.items() if k not in ("rope_theta", "rope_scaling")}
    return dict(base, rope_parameters=full), dict(base, rope_parameters=local)
