"""The layer ops (gpu_worker/layers/ops.py) by the Triton kernels of gpu_worker/kernels/, for
CUDA models.

    rms_norm      one kernel per norm instead of ~5 torch ops
    add_rms_norm  the residual add fused into the post-attention norm
    rope/rotate   q and k rotated in place, cos/sin tables indexed on device by position
    silu_mul      torch (one fused elementwise op on CUDA already)

Chosen at load by gpu_worker/layers/kernel_choice.py when the runner uses the triton backend; the
torch ops serve every other model. Every op reads device tensors only, so CUDA graphs
capture it.
"""

from __future__ import annotations

import torch

from gpu_worker.kernels.rmsnorm.kernel import fused_add_rms_norm, rms_norm
from gpu_worker.kernels.rotary.kernel import rotary_embedding
from gpu_worker.layers.ops import Rope, TorchLayerOps


class TritonLayerOps(TorchLayerOps):
    """Norms and rotary by the Triton kernels; the rope is (cos table, sin table,
    positions): the rotary kernel gathers each token's angles itself."""

    name = "triton"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        shape = x.shape
        return rms_norm(x.reshape(-1, shape[-1]), weight, eps).view(shape)

    def add_rms_norm(
        self, h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return fused_add_rms_norm(h, x, weight, eps)

    def rope(
        self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
    ) -> Rope:
        return cos, sin, positions

    def rotate(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        cos, sin, positions = rope
        rotary_embedding(positions, x, None, cos, sin)
        return x
