"""The few numbers the Llama-skeleton models (gpu_worker/models/llama.py) need, read from a
Hugging Face config.json: which families are served (a config of another `model_type` is
refused by name), and each family's differences as fields (Gemma's through
gpu_worker/models/config_checks.py, the mixtures of experts' through gpu_worker/models/moe.py,
rope scalings through gpu_worker/models/rope.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

from gpu_worker.models import moe
from gpu_worker.models.config_checks import (
    GEMMA_TYPES,
    check_activation,
    gemma3_ropes,
    gemma_fields,
    layer_windows,
    rope_layers,
)
from gpu_worker.models.moe import MoeConfig
from gpu_worker.models.rope import rope_scaling, rope_theta, rotary_dim

DENSE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "smollm3", *GEMMA_TYPES)
# the mixture-of-experts families: gpu_worker/models/moe.py
SUPPORTED_MODEL_TYPES = DENSE_MODEL_TYPES + moe.MOE_MODEL_TYPES


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The few numbers our model needs, read from a Hugging Face config.json."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # gpu_worker/models/rope.py's, None for plain rope
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    # OLMoE: q and k normed over the whole projection, before the heads split (not per head)
    qk_norm_whole: bool = False
    # the experts of a mixture-of-experts family (gpu_worker/models/moe.py), None if dense
    moe: MoeConfig | None = None
    # each layer's sliding window, 0 where it attends to its whole context (empty: none has
    # one); gpu_worker/models/config_checks.py reads it as transformers does per family
    sliding_windows: tuple[int, ...] = ()
    # whether each layer rotates q and k (empty: every layer does; SmolLM3's no_rope_layers)
    rope_layers: tuple[bool, ...] = ()
    # Gemma's (the defaults: Llama's layer)
    norm_offset: float = 0.0  # every RMSNorm multiplies by (norm_offset + weight)
    sandwich_norms: bool = False  # norms on both sides of attention and MLP
    gelu_tanh: bool = False  # GeGLU (gelu tanh) in place of SwiGLU
    embed_scale: float = 1.0
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float = 0.0  # 0: none
    final_softcap: float = 0.0
    # Gemma 3: the sliding layers' own rope (theta 0: every layer rotates by the one rope)
    local_rope_theta: float = 0.0
    local_rope_scaling: dict[str, Any] | None = None
    # gpt-oss: a learned logit per head in each softmax (the attention backends' sinks)
    attention_sinks: bool = False
    # how many of each head's dims rotate (0: all; Phi-4-mini's partial_rotary_factor 0.75)
    partial_rotary_dim: int = 0

    @property
    def rotary_dim(self) -> int:
        """The rotated dims of each head (the first ones; the rest pass through)."""
        return self.partial_rotary_dim or self.head_dim

    def sliding_window(self, layer: int) -> int:
        """Layer `layer`'s sliding window, 0 for the whole context."""
        return self.sliding_windows[layer] if self.sliding_windows else 0

    def uses_rope(self, layer: int) -> bool:
        """Whether layer `layer` rotates q and k."""
        return self.rope_layers[layer] if self.rope_layers else True

    def uses_local_rope(self, layer: int) -> bool:
        """Whether layer `layer` rotates by the local rope (Gemma 3's sliding layers)."""
        return self.local_rope_theta > 0 and self.sliding_window(layer) > 0

    @property
    def is_llama_layout(self) -> bool:
        """The plain Llama layer (what the CPU's one-call step computes: gpt-oss's sinks
        included)."""
        gemma = self.sandwich_norms or self.gelu_tanh or self.norm_offset or self.embed_scale != 1.0
        scores = self.attn_softcap or self.final_softcap
        return not (gemma or scores or self.local_rope_theta or self.rope_layers)

    def attention_options(self) -> dict[str, Any]:
        """The attention backend's keyword arguments for this model's scores."""
        return {"scale": self.attn_scale, "softcap": self.attn_softcap}

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> LlamaConfig:
        model_type = cfg.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
        num_heads = cfg["num_attention_heads"]
        if model_type in GEMMA_TYPES:
            return cls._from_gemma(cfg, model_type)
        check_activation(cfg)
        windows = layer_windows(cfg, model_type, cfg["num_hidden_layers"])
        # transformers' Mistral has no biases, Qwen2 q/k/v biases only, whatever the config;
        # gpt-oss q/k/v/o biases unless attention_bias is false
        reads_bias = model_type in ("llama", "qwen3", "smollm3")
        attention_bias = reads_bias and bool(cfg.get("attention_bias"))
        if model_type == "gpt_oss":
            attention_bias = bool(cfg.get("attention_bias", True))
        no_rope = model_type == "smollm3" and not all(rope_layers(cfg))
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        rotated = rotary_dim(cfg, head_dim)
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta(cfg),
            rope_scaling=rope_scaling(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias or moe.qkv_bias(cfg),
            o_bias=attention_bias,
            mlp_bias=model_type in ("llama", "smollm3") and bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "olmoe"),
            qk_norm_whole=model_type == "olmoe",
            moe=MoeConfig.from_hf(cfg),
            sliding_windows=windows if any(windows) else (),
            rope_layers=rope_layers(cfg) if no_rope else (),
            attention_sinks=model_type == "gpt_oss",
            partial_rotary_dim=rotated if rotated != head_dim else 0,
        )

    @classmethod
    def _from_gemma(cls, cfg: dict[str, Any], model_type: str) -> LlamaConfig:
        num_heads, num_layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
        attention_bias = bool(cfg.get("attention_bias", False))
        rope_cfg, local_cfg = gemma3_ropes(cfg) if model_type == "gemma3_text" else (cfg, None)
        rotary_dim(cfg, cfg.get("head_dim") or cfg["hidden_size"] // num_heads)  # refuses partial
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta(rope_cfg),
            rope_scaling=rope_scaling(rope_cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 8192),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=False,
            qk_norm=model_type == "gemma3_text",
            local_rope_theta=rope_theta(local_cfg) if local_cfg else 0.0,
            local_rope_scaling=rope_scaling(local_cfg) if local_cfg else None,
            **gemma_fields(cfg, model_type, num_layers),
        )
