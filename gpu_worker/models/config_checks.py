"""The config.json fields that change a served family's outputs, read or refused by name.

transformers reads a few fields per family beyond the shapes (its modeling_<family>.py):

    field                       families              here
    hidden_act                  all                   "silu" only (SwiGLU)
    sliding_window              mistral, phi3         read: every layer's window
    use_sliding_window,         qwen2, qwen3          read: the window of the layers
      sliding_window,                                 layer_types (or max_window_layers)
      max_window_layers,                              names "sliding_attention"
      layer_types
    attention_bias              llama, qwen3          q/k/v/o biases (qwen2: q/k/v always;
                                                      mistral, phi3: none)
    mlp_bias                    llama                 gate/up/down biases

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
    if model_type in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        window = None  # transformers drops the window unless use_sliding_window
    if model_type not in ("mistral", "phi3", "qwen2", "qwen3") or window is None:
        return (0,) * num_layers
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"sliding_window must be a positive integer, got {window!r}")
    if model_type in ("mistral", "phi3"):
        return (window,) * num_layers
    kinds = cfg.get("layer_types")
    if kinds is None:  # transformers' default: layers from max_window_layers on slide
        first = cfg.get("max_window_layers", 28)
        kinds = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if len(kinds) != num_layers:
        raise ValueError(f"layer_types has {len(kinds)} entries for {num_layers} layers")
    for kind in kinds:
        if kind not in ("sliding_attention", "full_attention"):
            raise ValueError(f"layer_types entry {kind!r} is not supported")
    return tuple(window if kind == "sliding_attention" else 0 for kind in kinds)
