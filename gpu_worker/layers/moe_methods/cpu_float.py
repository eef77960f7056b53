"""Float32 experts on the CPU by linear.c's GEMM (linear_gemm, on weights packed into its
panels at load: `w13_weight` [E, ceil(2I / 16), H, 16], `w2_weight` [E, ceil(H / 16), I,
16]), bfloat16 by its row-by-row kernel at most linear.MAX_ROWS rows per call: either way a
row's result never depends on the others in its call, so an expert's output for a token is
the same bits however many tokens the step routes to it. A float32 layer runs whole in moe.c
(gpu_worker/cpu/moe.py: routing, the same kernel, the weighted sum), as the one-call step
does; bfloat16 activations loop over the experts in Python (gpu_worker/cpu/linear.py), and
dtypes the kernel does not take go to torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu_worker.cpu import linear
from gpu_worker.cpu import moe as cpu_moe
from gpu_worker.cpu.moe import MoEExperts
from gpu_worker.cpu.one_call_descriptors import Keep
from gpu_worker.layers.fused_moe import ExpertWeights, FloatMoEMethod, FusedMoE
from gpu_worker.layers.linear import set_parameter
from gpu_worker.layers.moe_methods.c_kernel import CKernelExperts, moe_c_experts


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] @ weight.T (+ bias) for a bfloat16 (or, without linear.c, float) weight
    [out, in]: by linear.c's few-row kernel at most MAX_ROWS rows at a time, else torch."""
    step = linear.MAX_ROWS.get(weight.dtype, 0)
    if step == 0 or x.shape[0] == 0:
        return F.linear(x, weight, bias)
    parts = []
    for lo in range(0, x.shape[0], step):
        y = linear.linear_small(x[lo : lo + step], weight, bias)
        if y is None:  # the library could not be had
            return F.linear(x, weight, bias)
        parts.append(y)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class CpuFloatMoEMethod(CKernelExperts, FloatMoEMethod):
    """Float experts on the CPU (see the module docstring)."""

    name = "cpu_float"
    panels = False  # float32 experts packed for linear.c's GEMM (where it builds)

    def load_weights(self, layer: FusedMoE, experts: ExpertWeights) -> None:
        super().load_weights(layer, experts)
        w13, w2 = layer.w13_weight, layer.w2_weight
        if w13.dtype == w2.dtype == torch.float32 and linear.load() is not None:
            set_parameter(layer, "w13_weight", linear.pack_panels(w13))
            set_parameter(layer, "w2_weight", linear.pack_panels(w2))
            self.panels = True

    def _runs_moe_c(self) -> bool:
        return True

    def one_call_experts(self, layer: FusedMoE, keep: Keep) -> MoEExperts | None:
        w13 = layer.w13_weight
        if layer.w2_weight.dtype != w13.dtype:
            return None
        if w13.dtype == torch.float32 and self.panels:
            return moe_c_experts(layer, cpu_moe.KIND_F32, keep)
        if w13.dtype == torch.bfloat16:
            return moe_c_experts(layer, cpu_moe.KIND_BF16, keep)
        return None

    def gate_up(self, layer: FusedMoE, expert: int, x: torch.Tensor) -> torch.Tensor:
        bias = None if layer.w13_bias is None else layer.w13_bias[expert]
        return self._project(x, layer.w13_weight[expert], bias, 2 * layer.width)

    def down(self, layer: FusedMoE, expert: int, x: torch.Tensor) -> torch.Tensor:
        bias = None if layer.w2_bias is None else layer.w2_bias[expert]
        return self._project(x, layer.w2_weight[expert], bias, layer.hidden_size)

    def _project(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: int
    ) -> torch.Tensor:
        if not self.panels:
            return rows_linear(x, weight, bias)
        y = linear.linear_gemm(x.float(), weight, bias, out)
        if y is None:  # an input the kernel does not take: torch on the weight unpacked
            y = F.linear(x.float(), linear.unpack_panels(weight, out), bias)
        return y.to(x.dtype)
