"""The Llama family (Llama, SmolLM2, Mistral, Qwen2, Qwen3) over a paged KV cache, and the
mixture-of-experts families on its skeleton (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE:
gpu_worker/models/moe.py gives their sparse MLP blocks).

A decoder-only transformer with pre-norm residual blocks:

    x = embed(tokens)
    for each layer:  x = x + attn(rmsnorm(x));  x = x + mlp(rmsnorm(x))
    logits = lm_head(rmsnorm(x))                 (only at the positions that sample)

Attention uses rotary position embeddings (rotate-half / "neox" layout as in HF Llama) and
grouped-query heads; Qwen2 adds q/k/v biases, Qwen3 an RMSNorm per head on q and k before
rotary. q/k/v are one fused matmul and gate/up another (the loader concatenates weights).
Tokens of every request in the step are packed into one [T] sequence; the attention backend
and its metadata (passed in, per step) keep requests apart.

What runs is chosen once at load and held where it is used: each `Linear` holds its method
(gpu_worker/layers/linear.py: float, GGUF, int8; torch, C or Triton), the norms, attention and
MLP hold the layer ops (gpu_worker/layers/ops.py), and `LlamaModel.one_call_step` the CPU's
one-call step where it takes the model (gpu_worker/cpu/one_call_step.py: it reads the model
through its Protocols, which these classes fill).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Protocol, cast

import torch
from torch import nn

from gpu_worker.attention import AttentionBackend, AttentionMetadata
from gpu_worker.distributed.sharding import vocab_shard_size
from gpu_worker.distributed.tensor_parallel import TensorParallel, VocabParallelEmbedding
from gpu_worker.layers.linear import Linear
from gpu_worker.layers.ops import TORCH_OPS, LayerOps, Rope, rotate_neox
from gpu_worker.models import moe
from gpu_worker.models.moe import MoeConfig, SparseMoeBlock

DENSE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
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
    rope_scaling: dict[str, Any] | None  # llama3 parameters, None for plain rope
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

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> LlamaConfig:
        model_type = cfg.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
        num_heads = cfg["num_attention_heads"]
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(cfg),
            rope_scaling=_rope_scaling(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias or moe.qkv_bias(cfg),
            o_bias=attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "olmoe"),
            qk_norm_whole=model_type == "olmoe",
            moe=MoeConfig.from_hf(cfg),
        )


def _rope_params(cfg: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 keeps rope settings in rope_parameters, older configs in rope_scaling."""
    return cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}


def _rope_theta(cfg: dict[str, Any]) -> float:
    return float(cfg.get("rope_theta") or _rope_params(cfg).get("rope_theta") or 10000.0)


def _rope_scaling(cfg: dict[str, Any]) -> dict[str, Any] | None:
    params = _rope_params(cfg)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings are not supported")
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        raise ValueError(f"rope_type {rope_type!r} is not supported (default, llama3)")
    return params


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], with Llama 3.1's wavelength-dependent scaling."""
    # on the CPU explicitly, as HF does, even while the loader builds modules on "meta"
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    low_freq_factor, high_freq_factor = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are divided by factor, short ones kept, the band between interpolated
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dimension, by the layer ops (torch: in float32 like
    HF, then cast back)."""

    def __init__(self, dim: int, eps: float, ops: LayerOps = TORCH_OPS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Rotates q and k by position; cos/sin tables are precomputed for every position."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        device: torch.device,
        is_neox_style: bool = True,
    ) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling).to(device)
        positions = torch.arange(max_positions, device=device, dtype=torch.float)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim // 2]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)
        self.is_neox_style = is_neox_style

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, head_dim // 2] for the step's tokens: one angle per pair."""
        cos, sin = self.tables()
        return cos[positions].unsqueeze(1).to(dtype), sin[positions].unsqueeze(1).to(dtype)

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos and sin buffers [max_positions, head_dim // 2] (typed: register_buffer
        attributes read as Tensor | Module to a type checker)."""
        cos, sin = self.cos, self.sin
        assert isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)
        return cos, sin

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] rotated pair by pair."""
        if self.is_neox_style:  # pairs are (i, i + d/2): HF's rotate_half
            return rotate_neox(x, cos, sin)
        x1, x2 = x[..., 0::2], x[..., 1::2]  # pairs are (2i, 2i + 1): GPT-J
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


class Attention(nn.Module):
    """Grouped-query self-attention; the backend stores K/V and attends over the cache.
    Under tensor parallelism it holds this rank's heads and KV heads; its o_proj output is
    a partial sum (the decoder layer all-reduces it)."""

    def __init__(
        self,
        cfg: LlamaConfig,
        backend: AttentionBackend,
        tp: TensorParallel,
        ops: LayerOps = TORCH_OPS,
    ) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads // tp.size
        self.num_kv_heads = cfg.num_kv_heads // tp.size
        self.head_dim = cfg.head_dim
        q_size, kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=cfg.o_bias)
        # per head, or over the whole q / k projection (OLMoE, one rank: gpu_worker/models/moe.py)
        q_norm_dim, k_norm_dim = (q_size, kv_size) if cfg.qk_norm_whole else (cfg.head_dim,) * 2
        self.qk_norm_whole = cfg.qk_norm_whole
        self.q_norm = RMSNorm(q_norm_dim, cfg.rms_norm_eps, ops) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_norm_dim, cfg.rms_norm_eps, ops) if cfg.qk_norm else None
        self.backend = backend
        self.ops = ops

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        if self.q_norm is not None and self.k_norm is not None and self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None and not self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.ops.rotate(q, rope), self.ops.rotate(k, rope)
        o = self.backend.forward(q, k, v, kv_cache, meta)
        return self.o_proj(o.reshape(num_tokens, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up as one matmul (this rank's
    share of the width under tensor parallelism: down's output is then a partial sum)."""

    def __init__(
        self, cfg: LlamaConfig, tp: TensorParallel | None = None, ops: LayerOps = TORCH_OPS
    ) -> None:
        super().__init__()
        width = cfg.intermediate_size // (tp.size if tp else 1)
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * width, bias=cfg.mlp_bias)
        self.down_proj = Linear(width, cfg.hidden_size, bias=cfg.mlp_bias)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each added to the residual stream; under tensor
    parallelism each branch's partial output is all-reduced first (2 per layer)."""

    def __init__(
        self,
        cfg: LlamaConfig,
        backend: AttentionBackend,
        tp: TensorParallel,
        ops: LayerOps = TORCH_OPS,
        layer_idx: int = 0,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.self_attn = Attention(cfg, backend, tp, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        sparse = cfg.moe is not None and cfg.moe.is_sparse(layer_idx)
        self.mlp: MLP | SparseMoeBlock = (
            SparseMoeBlock(cfg.moe, cfg.hidden_size, tp, ops)
            if cfg.moe is not None and sparse
            else MLP(cfg, tp, ops)
        )
        self.tp = tp
        self.ops = ops

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        h = self.tp.all_reduce(self.self_attn(self.input_layernorm(x), rope, kv_cache, meta))
        norm = self.post_attention_layernorm
        h, x = self.ops.add_rms_norm(h, x, norm.weight, norm.eps)
        return x + self.tp.all_reduce(self.mlp(h))


class OneCallStepProtocol(Protocol):
    """What `LlamaModel.one_call_step` holds: a kernel that runs a whole decode step through
    every decoder layer, for the steps it takes (the CPU's OneCallStep,
    gpu_worker/cpu/one_call_step.py, or LoRA's guard around it, gpu_worker/lora/manager.py)."""

    def forward(
        self,
        model: LlamaModel,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor | None:
        """The hidden states after the last layer, or None for a step it does not take (the
        model then runs its layers)."""
        ...


class LlamaModel(nn.Module):
    """Embedding, the decoder layers and the final norm (module names follow HF)."""

    def __init__(
        self,
        cfg: LlamaConfig,
        backend: AttentionBackend,
        *,
        max_positions: int,
        device: torch.device,
        tp: TensorParallel,
        ops: LayerOps = TORCH_OPS,
    ) -> None:
        super().__init__()
        self.embed_tokens: nn.Module = (
            nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            if tp.size == 1
            else VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        )
        # built on `device` explicitly: the loader constructs the rest on "meta"
        self.rotary = RotaryEmbedding(
            cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, device
        )
        # a ModuleList (registered submodules), typed as what it holds
        self.layers = cast(
            Sequence[DecoderLayer],
            nn.ModuleList(
                DecoderLayer(cfg, backend, tp, ops, layer_idx=i) for i in range(cfg.num_layers)
            ),
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.ops = ops
        self.tp = tp
        # the one-call step, when the loader's kernel choice has one that takes this model
        self.one_call_step: OneCallStepProtocol | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if self.one_call_step is not None:
            hidden = self.one_call_step.forward(self, input_ids, positions, kv_cache, meta)
            if hidden is not None:
                return hidden
        x = self.embed_tokens(input_ids)
        # once per step, shared by every layer
        rope = self.ops.rope(*self.rotary.tables(), positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, kv_cache[i], meta)
        return x  # before the final norm, which only the sampled positions need


class LlamaForCausalLM(nn.Module):
    """The model plus its LM head; forward returns float32 logits for chosen positions.
    With `tp` of size N it is one rank's shard (gpu_worker/distributed/sharding.py): the LM head
    holds a vocabulary slice and the logits are all-gathered, so every rank returns all of them."""

    def __init__(
        self,
        cfg: LlamaConfig,
        backend: AttentionBackend,
        *,
        max_positions: int,
        device: torch.device,
        tp: TensorParallel | None = None,
        ops: LayerOps = TORCH_OPS,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp = tp or TensorParallel()
        self.model = LlamaModel(
            cfg, backend, max_positions=max_positions, device=device, tp=tp, ops=ops
        )
        vocab = vocab_shard_size(cfg.vocab_size, tp.size)
        self.lm_head = Linear(cfg.hidden_size, vocab, bias=False)

    def linears(self) -> list[tuple[str, Linear]]:
        """Every linear layer with its name, in the model's order."""
        return [(n, m) for n, m in self.named_modules() if isinstance(m, Linear)]

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # [S] which of the T tokens sample
    ) -> torch.Tensor:  # [S, vocab_size] float32
        hidden = self.model(input_ids, positions, kv_cache, meta)
        hidden = self.model.norm(hidden[logits_indices])
        return self.tp.gather_vocab(self.lm_head(hidden), self.config.vocab_size).float()

    def forward_hidden(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # [S] which of the T tokens sample
        hidden_indices: torch.Tensor,  # [P] which of the T tokens pool (embeddings)
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [S, vocab_size], [P, hidden_size] float32
        """`forward`'s logits, and the final-normed hidden states of `hidden_indices` (no LM
        head): what an embeddings request pools (gpu_worker/sample/pooling.py). The norm is per
        row, so a row's hidden state does not depend on the others."""
        hidden = self.model(input_ids, positions, kv_cache, meta)
        normed = self.model.norm(hidden[torch.cat((logits_indices, hidden_indices))])
        num_sampled = logits_indices.shape[0]
        logits = self.tp.gather_vocab(self.lm_head(normed[:num_sampled]), self.config.vocab_size)
        return logits.float(), normed[num_sampled:].float()
