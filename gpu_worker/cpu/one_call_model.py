"""The shape of a model the one-call step takes (gpu_worker/cpu/one_call_step.py), as
Protocols: gpu_worker/models/llama.py's classes fill them, and the step reads a model through
them alone, so the kernels' package imports no model class."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from gpu_worker.kv_quant import KVFormat

if TYPE_CHECKING:
    from gpu_worker.cpu.moe import MoEExperts
    from gpu_worker.cpu.one_call_descriptors import DecodeLinear, Keep


class OneCallLinear(Protocol):
    """A linear layer (gpu_worker/layers/linear.py's Linear)."""

    @property
    def weight(self) -> torch.Tensor: ...

    @property
    def bias(self) -> torch.Tensor | None: ...

    @property
    def in_features(self) -> int: ...

    @property
    def method(self) -> object: ...

    def one_call_linear(self, keep: Keep) -> DecodeLinear | None:
        """Its method's descriptor (bias aside), or None when the C loop cannot run it."""
        ...


class OneCallBackend(Protocol):
    @property
    def scale(self) -> float: ...

    @property
    def cpu_decode_kernel(self) -> bool:
        """Decodes run paged_decode.c, the kernel the C loop attends with."""
        ...

    @property
    def kv_format(self) -> KVFormat:
        """How the cache's rows are stored (the C loop stores and reads them so)."""
        ...


class OneCallNorm(Protocol):
    @property
    def weight(self) -> torch.Tensor: ...

    @property
    def eps(self) -> float: ...

    @property
    def offset(self) -> float:
        """Gemma's multiply by (offset + weight); the step takes 0 only."""
        ...


class OneCallAttention(Protocol):
    @property
    def num_heads(self) -> int: ...

    @property
    def num_kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def q_norm(self) -> OneCallNorm | None: ...

    @property
    def k_norm(self) -> OneCallNorm | None: ...

    @property
    def qk_norm_whole(self) -> bool:
        """The q/k norms span the whole projections (OLMoE), not each head."""
        ...

    @property
    def sinks(self) -> torch.Tensor | None:
        """gpt-oss's logit per head in each softmax, or None."""
        ...

    @property
    def sliding_window(self) -> int:
        """The layer's sliding window, 0 for the whole context."""
        ...

    @property
    def backend(self) -> OneCallBackend: ...

    @property
    def qkv_proj(self) -> OneCallLinear: ...

    @property
    def o_proj(self) -> OneCallLinear: ...


class OneCallMLP(Protocol):
    @property
    def gate_up_proj(self) -> OneCallLinear: ...

    @property
    def down_proj(self) -> OneCallLinear: ...


class OneCallLayer(Protocol):
    @property
    def input_layernorm(self) -> OneCallNorm: ...

    @property
    def post_attention_layernorm(self) -> OneCallNorm: ...

    @property
    def self_attn(self) -> OneCallAttention: ...

    @property
    def mlp(self) -> object:
        """A dense MLP (OneCallMLP: `dense_mlp` gives it), or a mixture of experts' block
        (OneCallSparseMLP: `sparse_mlp` gives it)."""
        ...


class OneCallRouting(Protocol):
    """gpu_worker/layers/moe_routing.py's Routing."""

    @property
    def top_k(self) -> int: ...

    @property
    def scoring(self) -> str: ...

    @property
    def renormalize(self) -> bool: ...


class OneCallExpertsMethod(Protocol):
    def one_call_experts(self, layer: Any, keep: Keep) -> MoEExperts | None:
        """The experts as moe.c reads them, or None when moe.c cannot run them."""
        ...


class OneCallExperts(Protocol):
    """gpu_worker/layers/fused_moe.py's FusedMoE."""

    @property
    def num_experts(self) -> int: ...

    @property
    def routing(self) -> OneCallRouting: ...

    @property
    def method(self) -> OneCallExpertsMethod: ...

    def count_tokens(self, counts: list[int]) -> None: ...


class OneCallSparseMLP(Protocol):
    """gpu_worker/models/moe.py's SparseMoeBlock: router, experts, Qwen2-MoE's shared expert."""

    @property
    def gate(self) -> OneCallLinear: ...

    @property
    def experts(self) -> OneCallExperts: ...

    @property
    def shared_expert(self) -> OneCallMLP | None: ...

    @property
    def shared_expert_gate(self) -> OneCallLinear | None: ...


def dense_mlp(layer: OneCallLayer) -> OneCallMLP | None:
    """The layer's MLP if it is dense (gate_up_proj and down_proj), else None."""
    mlp = layer.mlp
    return cast(OneCallMLP, mlp) if hasattr(mlp, "gate_up_proj") else None


def sparse_mlp(layer: OneCallLayer) -> OneCallSparseMLP | None:
    """The layer's MLP if it is a mixture of experts' block (a router and experts), else
    None."""
    mlp = layer.mlp
    return cast(OneCallSparseMLP, mlp) if hasattr(mlp, "experts") else None


class OneCallRotary(Protocol):
    @property
    def is_neox_style(self) -> bool: ...

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]: ...


class OneCallParallel(Protocol):
    @property
    def size(self) -> int: ...


class OneCallModel(Protocol):
    """The decoder stack (gpu_worker/models/llama.py's LlamaModel) as the step reads it."""

    @property
    def embed_tokens(self) -> Callable[[torch.Tensor], torch.Tensor]: ...

    @property
    def layers(self) -> Sequence[OneCallLayer]: ...

    @property
    def rotary(self) -> OneCallRotary: ...

    @property
    def tp(self) -> OneCallParallel: ...

    # KV layer groups (common/kv_groups.py): per layer its slot of the KV tensor and group
    @property
    def kv_slot(self) -> Sequence[int]: ...

    @property
    def kv_group(self) -> Sequence[int]: ...

    def parameters(self) -> Iterator[torch.nn.Parameter]: ...
