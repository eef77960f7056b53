"""Mixture-of-experts families on the Llama skeleton (gpu_worker/models/llama.py): Qwen3-MoE,
Qwen2-MoE (a shared expert beside the routed ones), Mixtral, OLMoE and gpt-oss.

They share Llama's decoder layer (pre-norm attention, then an MLP) and differ in the MLP of
their sparse layers: a router (`gate`, a Linear to one logit per expert) and `experts`
(gpu_worker/layers/fused_moe.py's FusedMoE, routing as the family defines it), plus for
Qwen2-MoE a dense `shared_expert` whose output is scaled by sigmoid(`shared_expert_gate`(x))
and added. Which layers are sparse: every `decoder_sparse_step`-th layer not in
`mlp_only_layers` (Qwen-MoE), every layer (Mixtral, OLMoE); the others keep a dense MLP of
`intermediate_size`. The attention side differs little: Qwen2-MoE has q/k/v biases (its
`qkv_bias`), Qwen3-MoE Qwen3's per-head q/k norms, OLMoE an RMSNorm over the whole q and k
projections (before the heads are split). gpt-oss's router (`mlp.router`, read as `gate`) has a
bias and takes the top-k logits then a softmax over them; its experts have biases and the
clamped SwiGLU on alternate gate/up columns; its attention (biases, sinks, alternating
windows) is llama.py's with `LlamaConfig.attention_sinks`.

`MoeConfig.from_hf` reads the fields; a field that would change outputs and is not served
(a sliding window, OLMoE's `clip_qkv`, another activation) is refused by name.

Under tensor parallelism the router (and the shared expert's gate) is replicated and every
expert's FFN is sharded like a dense MLP: gate/up by output rows, down by input columns
(the checkpoint's per-expert names shard as the dense ones do; gpt-oss's stacked experts,
float or MXFP4, as gpu_worker/distributed/sharding.py draws them, its sinks with the heads,
its down biases on rank 0), so each rank's block output is a partial sum the decoder layer's
all-reduce joins. OLMoE's q/k norms span every head: it is served on one rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from gpu_worker.distributed.tensor_parallel import TensorParallel
from gpu_worker.layers.fused_moe import FusedMoE
from gpu_worker.layers.linear import Linear
from gpu_worker.layers.moe_routing import Routing
from gpu_worker.layers.ops import TORCH_OPS, LayerOps

MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss")


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """A MoE family's expert fields, from its config.json."""

    num_experts: int
    width: int  # each expert's intermediate size
    routing: Routing
    shared_expert_width: int  # 0: none
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    # gpt-oss: a router bias, experts' biases and the clamped SwiGLU (fused_moe.ACTIVATIONS)
    router_bias: bool = False
    expert_bias: bool = False
    activation: str = "silu"
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> MoeConfig | None:
        """The expert fields of a MoE family's config, None for a dense model_type. Raises
        ValueError naming a field whose value is not served."""
        model_type = cfg.get("model_type", "")
        if model_type not in MOE_MODEL_TYPES:
            return None
        top_k = int(cfg["num_experts_per_tok"])
        if model_type == "gpt_oss":
            _refuse_unserved_gpt_oss(cfg)
            return cls(
                num_experts=int(cfg["num_local_experts"]),
                width=int(cfg["intermediate_size"]),
                routing=Routing(top_k, renormalize=False, scoring="topk_softmax"),
                shared_expert_width=0,
                decoder_sparse_step=1,
                mlp_only_layers=(),
                router_bias=True,
                expert_bias=True,
                activation="swiglu_clamp",
                swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
                swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
            )
        _refuse_unserved(cfg, model_type)
        if model_type == "mixtral":
            num_experts = int(cfg["num_local_experts"])
            width = int(cfg["intermediate_size"])
            routing = Routing(top_k, renormalize=True, weights_in_logits_dtype=False)
        else:
            # transformers 5 writes Qwen3-MoE's expert count as num_local_experts
            num_experts = int(cfg.get("num_experts") or cfg["num_local_experts"])
            width = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
            routing = Routing(top_k, renormalize=bool(cfg.get("norm_topk_prob", False)))
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} is not in [1, {num_experts}] experts")
        shared = int(cfg.get("shared_expert_intermediate_size") or 0)
        return cls(
            num_experts=num_experts,
            width=width,
            routing=routing,
            shared_expert_width=shared if model_type == "qwen2_moe" else 0,
            decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
        )

    def is_sparse(self, layer_idx: int) -> bool:
        """Whether decoder layer `layer_idx` has experts (else a dense MLP)."""
        return (
            layer_idx not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )


def _refuse_unserved(cfg: dict[str, Any], model_type: str) -> None:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{model_type}: hidden_act {act!r} is not served (silu)")
    if model_type == "mixtral" and cfg.get("sliding_window") is not None:
        raise ValueError(
            f"mixtral: sliding_window {cfg['sliding_window']} is not served (null: full attention)"
        )
    if cfg.get("use_sliding_window"):
        raise ValueError(f"{model_type}: use_sliding_window is true; full attention is served")
    if model_type == "olmoe" and cfg.get("clip_qkv") is not None:
        raise ValueError(f"olmoe: clip_qkv {cfg['clip_qkv']} is not served (null)")
    if model_type == "qwen2_moe" and cfg.get("shared_expert_intermediate_size", 0) <= 0:
        raise ValueError("qwen2_moe: shared_expert_intermediate_size must be > 0")


def _refuse_unserved_gpt_oss(cfg: dict[str, Any]) -> None:
    """gpt-oss's experts always run the clamped SwiGLU (transformers ignores hidden_act);
    refuse what would change the routing."""
    top_k, num = int(cfg["num_experts_per_tok"]), int(cfg["num_local_experts"])
    if not 1 <= top_k <= num:
        raise ValueError(f"num_experts_per_tok {top_k} is not in [1, {num}] experts")


def qkv_bias(cfg: dict[str, Any]) -> bool:
    """Whether a MoE family's q/k/v projections have biases (Qwen2-MoE's `qkv_bias`)."""
    return cfg.get("model_type") == "qwen2_moe" and bool(cfg.get("qkv_bias", True))


def check_tensor_parallel(moe: MoeConfig, model_type: str, world: int, model: str) -> None:
    """Refuse (ValueError naming --tensor-parallel-size) a MoE model that does not split."""
    if world == 1:
        return
    if model_type == "olmoe":
        raise ValueError(
            f"--tensor-parallel-size {world}: {model} is olmoe, whose q/k norms span every "
            "head; it is served on one rank"
        )
    for what, n in (
        ("expert width (moe_intermediate_size)", moe.width),
        ("shared expert width (shared_expert_intermediate_size)", moe.shared_expert_width),
    ):
        if n % world:
            raise ValueError(
                f"--tensor-parallel-size {world} does not divide {model}'s {what} = {n}"
            )


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert: a dense SwiGLU MLP (this rank's share of its width)."""

    def __init__(self, hidden_size: int, width: int, ops: LayerOps) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * width, bias=False)
        self.down_proj = Linear(width, hidden_size, bias=False)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_mul(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    """A sparse layer's MLP: router, experts and (Qwen2-MoE) the gated shared expert. Under
    tensor parallelism its output is a partial sum (see the module docstring)."""

    def __init__(
        self,
        moe: MoeConfig,
        hidden_size: int,
        tp: TensorParallel | None = None,
        ops: LayerOps = TORCH_OPS,
    ) -> None:
        super().__init__()
        size = tp.size if tp else 1
        self.gate = Linear(hidden_size, moe.num_experts, bias=moe.router_bias)
        self.experts = FusedMoE(
            moe.num_experts,
            hidden_size,
            moe.width // size,
            moe.routing,
            activation=moe.activation,
            bias=moe.expert_bias,
            swiglu_limit=moe.swiglu_limit,
            swiglu_alpha=moe.swiglu_alpha,
            ops=ops,
        )
        self.shared_expert: SharedExpert | None = None
        self.shared_expert_gate: Linear | None = None
        if moe.shared_expert_width:
            self.shared_expert = SharedExpert(hidden_size, moe.shared_expert_width // size, ops)
            self.shared_expert_gate = Linear(hidden_size, 1, bias=False)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = self.ops.add_gated(out, self.shared_expert(x), self.shared_expert_gate(x))
        return out
