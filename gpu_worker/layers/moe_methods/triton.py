"""Float experts on CUDA by the Triton fused MoE (gpu_worker/kernels/fused_moe): the step's
pairs sorted by expert and padded to the kernel's block, gate/up with silu(gate) * up fused,
down with the routing weights, then each token's experts added in expert id order. Biases or
gpt-oss's clamped SwiGLU go to torch (FloatMoEMethod's per-expert F.linear)."""

from __future__ import annotations

import torch

from gpu_worker.layers.fused_moe import FloatMoEMethod, FusedMoE, grouped_experts
from gpu_worker.layers.moe_routing import combine


class TritonMoEMethod(FloatMoEMethod):
    """Float experts [E, out, in] on CUDA (see the module docstring)."""

    name = "triton"

    def apply(
        self, layer: FusedMoE, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        if layer.w13_bias is not None or layer.w2_bias is not None or layer.activation != "silu":
            return grouped_experts(self, layer, x, weights, ids)
        from gpu_worker.kernels.fused_moe.kernel import fused_moe

        layer.count_tokens(torch.bincount(ids.flatten(), minlength=layer.num_experts).tolist())
        pairs = fused_moe(x.contiguous(), layer.w13_weight, layer.w2_weight, weights, ids)
        return combine(pairs, torch.ones_like(weights, dtype=torch.float32), ids, x.dtype)
