"""Swap a loaded Llama-family model's norms and rotary onto the Triton kernels.

`use_triton_layers(model)` changes the class of three kinds of modules in place (their
parameters, buffers and state-dict names stay as they are):

    RMSNorm          -> TritonRMSNorm          one kernel per norm instead of ~5 torch ops
    DecoderLayer     -> TritonDecoderLayer     residual add fused into the post-attention norm
    RotaryEmbedding  -> TritonRotaryEmbedding  q and k rotated in place, tables indexed on device

The torch path (models/llama.py) is untouched: a model gets these only when the runner uses
the triton backend. Every replacement reads device tensors only, so CUDA graphs capture it.
"""

from __future__ import annotations

import torch
from torch import nn

from gpu_worker.kernels.rmsnorm.kernel import fused_add_rms_norm, rms_norm
from gpu_worker.kernels.rotary.kernel import rotary_embedding
from gpu_worker.models.llama import DecoderLayer, RMSNorm, RotaryEmbedding, swap_module_classes


class TritonRMSNorm(RMSNorm):
    """RMSNorm over the last dimension by one kernel launch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        return rms_norm(x.reshape(-1, shape[-1]), self.weight, self.eps).view(shape)


class TritonRotaryEmbedding(RotaryEmbedding):
    """Hands the layers the cos/sin tables and positions; `rotate` runs the kernel in place.

    The torch version gathers cos/sin per token once per step; the kernel gathers them itself,
    so "rope" here is (cos table, sin table, positions) and is passed through unchanged.
    """

    def forward(  # type: ignore[override]  # rope is (cos, sin, positions) for the kernel
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (*self.tables(), positions)

    def rotate(  # type: ignore[override]  # takes positions too: the kernel gathers cos/sin
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        rotary_embedding(positions, x, None, cos, sin)
        return x


class TritonDecoderLayer(DecoderLayer):
    """DecoderLayer whose post-attention norm also performs the residual add."""

    def add_and_norm(self, h: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        norm = self.post_attention_layernorm
        return fused_add_rms_norm(h, x, norm.weight, norm.eps)


_SWAPS: dict[type[nn.Module], type[nn.Module]] = {
    RMSNorm: TritonRMSNorm,
    DecoderLayer: TritonDecoderLayer,
    RotaryEmbedding: TritonRotaryEmbedding,
}


def use_triton_layers(model: nn.Module) -> nn.Module:
    """Switch `model`'s norms, decoder layers and rotary to the Triton kernels; returns it."""
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            assert module.is_neox_style, "the rotary kernel implements the neox layout only"
    swap_module_classes(model, _SWAPS)
    return model
