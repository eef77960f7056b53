"""The Llama family (Llama, SmolLM2/3, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2, Gemma 3 text) over
a paged KV cache, and the mixture-of-experts families on its skeleton (Qwen3-MoE, Qwen2-MoE,
Mixtral, OLMoE, gpt-oss: gpu_worker/models/moe.py gives their sparse MLP blocks; gpt-oss's
attention adds q/k/v/o biases and a sink logit per head, passed to the backend).

A decoder-only transformer with pre-norm residual blocks:

    x = embed(tokens)
    for each layer:  x = x + attn(rmsnorm(x));  x = x + mlp(rmsnorm(x))
    logits = lm_head(rmsnorm(x))                 (only at the positions that sample)

Attention uses rotary position embeddings (rotate-half / "neox" layout as in HF Llama) and
grouped-query heads; Qwen2 adds q/k/v biases, Qwen3 an RMSNorm per head on q and k before
rotary, SmolLM3 layers without rotary. q/k/v are one fused matmul and gate/up another (the
loader concatenates weights; Phi-3's checkpoints hold them fused already, in the same order).
Gemma's differences are config fields (gpu_worker/models/config_checks.py draws them): norms
around both branches ("sandwich"), RMSNorm by (1 + weight), GeGLU, scaled embeddings, scaled and
soft-capped attention scores (the backend's), soft-capped logits, and Gemma 3's own rope for
its sliding layers. Tokens of every request in the step are packed into one [T] sequence;
the attention backend and its metadata (passed in, per step) keep requests apart.

What runs is chosen once at load and held where it is used: each `Linear` holds its method
(gpu_worker/layers/linear.py: float, GGUF, int8; torch, C or Triton), the norms, attention and
MLP hold the layer ops (gpu_worker/layers/ops.py), and `LlamaModel.one_call_step` the CPU's
one-call step where it takes the model (gpu_worker/cpu/one_call_step.py: it reads the model
through its Protocols, which these classes fill).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from common.kv_groups import layer_groups
from gpu_worker.attention import AttentionBackend, AttentionMetadata
from gpu_worker.distributed.sharding import vocab_shard_size
from gpu_worker.distributed.tensor_parallel import TensorParallel, VocabParallelEmbedding
from gpu_worker.layers.linear import Linear
from gpu_worker.layers.ops import TORCH_OPS, LayerOps, Rope, rotate_neox
from gpu_worker.models.llama_config import LlamaConfig
from gpu_worker.models.moe import SparseMoeBlock
from gpu_worker.models.rope import rope_attention_factor, rope_inv_freq


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dimension, by the layer ops (torch: in float32 like
    HF, then cast back); Gemma's multiply by (1 + weight): `offset` 1, computed as transformers'
    Gemma computes it (in float32, (1 + weight) in float32, then cast: the layer ops would round
    a bf16 model's 1 + weight to bf16 first)."""

    def __init__(self, dim: int, eps: float, ops: LayerOps = TORCH_OPS, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = ops
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.offset:
            return self.ops.rms_norm(x, self.weight, self.eps)
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (self.offset + self.weight.float())).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotates q and k by position; cos/sin tables are precomputed for every position up to
    `max_positions` (the served context, which also fixes longrope's factors: rope.py). The
    tables are [max_positions, rotary_dim // 2]: their width says how many of a head's dims
    rotate, to every layer op that reads them."""

    def __init__(
        self,
        rotary_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        device: torch.device,
        is_neox_style: bool = True,
    ) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(rotary_dim, theta, scaling, max_positions).to(device)
        positions = torch.arange(max_positions, device=device, dtype=torch.float)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, rotary_dim // 2]
        factor = rope_attention_factor(scaling)  # yarn's / longrope's, as transformers has it
        self.register_buffer("cos", freqs.cos() * factor, persistent=False)
        self.register_buffer("sin", freqs.sin() * factor, persistent=False)
        self.is_neox_style = is_neox_style

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, rotary_dim // 2] for the step's tokens: one angle per pair."""
        cos, sin = self.tables()
        return cos[positions].unsqueeze(1).to(dtype), sin[positions].unsqueeze(1).to(dtype)

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos and sin buffers [max_positions, rotary_dim // 2] (typed: register_buffer
        attributes read as Tensor | Module to a type checker)."""
        cos, sin = self.cos, self.sin
        assert isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)
        return cos, sin

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] rotated pair by pair."""
        if self.is_neox_style:  # pairs are (i, i + d/2): HF's rotate_half
            return rotate_neox(x, cos, sin)
        assert 2 * cos.shape[-1] == x.shape[-1], "GPT-J pairs rotate the whole head"
        x1, x2 = x[..., 0::2], x[..., 1::2]  # pairs are (2i, 2i + 1): GPT-J
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


class Attention(nn.Module):
    """Grouped-query self-attention; the backend stores K/V and attends over the cache (the
    last `sliding_window` positions of it, where that is not 0). Under tensor parallelism it
    holds this rank's heads and KV heads; its o_proj output is a partial sum (the decoder
    layer all-reduces it)."""

    def __init__(
        self,
        cfg: LlamaConfig,
        backend: AttentionBackend,
        tp: TensorParallel,
        ops: LayerOps = TORCH_OPS,
        sliding_window: int = 0,
        use_rope: bool = True,
    ) -> None:
        super().__init__()
        self.sliding_window = sliding_window
        self.use_rope = use_rope  # SmolLM3's no-rope layers: False
        self.num_heads = cfg.num_heads // tp.size
        self.num_kv_heads = cfg.num_kv_heads // tp.size
        self.head_dim = cfg.head_dim
        q_size, kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=cfg.o_bias)
        eps, offset = cfg.rms_norm_eps, cfg.norm_offset
        # per head, or over the whole q / k projection (OLMoE, one rank: gpu_worker/models/moe.py)
        q_norm_dim, k_norm_dim = (q_size, kv_size) if cfg.qk_norm_whole else (cfg.head_dim,) * 2
        self.qk_norm_whole = cfg.qk_norm_whole
        self.q_norm = RMSNorm(q_norm_dim, eps, ops, offset) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_norm_dim, eps, ops, offset) if cfg.qk_norm else None
        # gpt-oss's sinks [num_heads] (this model's dtype; the backends take them in float32)
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if cfg.attention_sinks else None
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
        if self.use_rope:
            q, k = self.ops.rotate(q, rope), self.ops.rotate(k, rope)
        sinks = None if self.sinks is None else self.sinks.float()
        o = self.backend.forward(q, k, v, kv_cache, meta, self.sliding_window, sinks)
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
        self.gelu_tanh = cfg.gelu_tanh  # Gemma's GeGLU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gelu_tanh:
            return self.down_proj(gelu_tanh_mul(self.gate_up_proj(x)))
        return self.down_proj(self.ops.silu_mul(self.gate_up_proj(x)))


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, tanh approximation) * up: Gemma's gelu_pytorch_tanh."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each added to the residual stream; under tensor
    parallelism each branch's partial output is all-reduced first (2 per layer). Gemma's
    layer normalizes each branch's output too (`sandwich_norms`): its post_attention_layernorm
    is the attention output's, pre_feedforward_layernorm the MLP input's."""

    def __init__(
        self,
        cfg: LlamaConfig,
        backend: AttentionBackend,
        tp: TensorParallel,
        ops: LayerOps = TORCH_OPS,
        layer_idx: int = 0,
    ) -> None:
        super().__init__()
        hidden, eps, offset = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset
        self.input_layernorm = RMSNorm(hidden, eps, ops, offset)
        self.self_attn = Attention(
            cfg, backend, tp, ops, cfg.sliding_window(layer_idx), cfg.uses_rope(layer_idx)
        )
        self.post_attention_layernorm = RMSNorm(hidden, eps, ops, offset)
        sparse = cfg.moe is not None and cfg.moe.is_sparse(layer_idx)
        self.mlp: MLP | SparseMoeBlock = (
            SparseMoeBlock(cfg.moe, cfg.hidden_size, tp, ops)
            if cfg.moe is not None and sparse
            else MLP(cfg, tp, ops)
        )
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(hidden, eps, ops, offset)
            self.post_feedforward_layernorm = RMSNorm(hidden, eps, ops, offset)
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
        if self.sandwich:
            x = x + self.post_attention_layernorm(h)
            h = self.tp.all_reduce(self.mlp(self.pre_feedforward_layernorm(x)))
            return x + self.post_feedforward_layernorm(h)
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
            cfg.rotary_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, device
        )
        # Gemma 3's sliding layers' rope, None where every layer rotates by `rotary`
        self.local_rotary = (
            RotaryEmbedding(
                cfg.head_dim, max_positions, cfg.local_rope_theta, cfg.local_rope_scaling, device
            )
            if cfg.local_rope_theta
            else None
        )
        self.uses_local_rope = [cfg.uses_local_rope(i) for i in range(cfg.num_layers)]
        # KV layer groups (used when the step's metadata has group_metas)
        groups = layer_groups(cfg.sliding_windows, cfg.num_layers)
        self.kv_slot, self.kv_group = groups.slot_of, groups.group_of
        self.embed_scale = cfg.embed_scale
        # a ModuleList (registered submodules), typed as what it holds
        self.layers = cast(
            Sequence[DecoderLayer],
            nn.ModuleList(
                DecoderLayer(cfg, backend, tp, ops, layer_idx=i) for i in range(cfg.num_layers)
            ),
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, cfg.norm_offset)
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
        groups = meta.group_metas  # KV layer groups: each layer its group's tables
        if self.one_call_step is not None:
            hidden = self.one_call_step.forward(self, input_ids, positions, kv_cache, meta)
            if hidden is not None:
                return hidden
        x = self.embed_tokens(input_ids)
        if self.embed_scale != 1.0:  # Gemma's, in the embedding's dtype as transformers has it
            x = x * torch.tensor(self.embed_scale, dtype=torch.float32).to(x.dtype)
        # once per step, shared by every layer (Gemma 3: one per rope)
        rope = self.ops.rope(*self.rotary.tables(), positions, x.dtype)
        local = self.local_rotary
        local_rope = rope if local is None else self.ops.rope(*local.tables(), positions, x.dtype)
        if groups:  # layer i keeps its KV in slot kv_slot[i] of its group's blocks
            for i, layer in enumerate(self.layers):
                r = local_rope if self.uses_local_rope[i] else rope
                x = layer(x, r, kv_cache[self.kv_slot[i]], groups[self.kv_group[i]])
            return x
        for i, layer in enumerate(self.layers):
            x = layer(x, local_rope if self.uses_local_rope[i] else rope, kv_cache[i], meta)
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
        return self._soft_cap(self.tp.gather_vocab(self.lm_head(hidden), self.config.vocab_size))

    def _soft_cap(self, logits: torch.Tensor) -> torch.Tensor:
        """float32 logits, soft-capped as transformers' Gemma does (final_logit_softcapping)."""
        cap = self.config.final_softcap
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

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
        return self._soft_cap(logits), normed[num_sampled:].float()
