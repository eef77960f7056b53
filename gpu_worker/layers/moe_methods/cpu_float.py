"""Float32 experts on the CPU by linear.c's GEMM (linear_gemm), bfloat16 by its row-by-row
kernel at most linear.MAX_ROWS rows per call: either way a row's result never depends on the
others in its call, so an expert's output for a token is the same bits however many tokens the
step routes to it. A float32 layer runs whole in moe.c (gpu_worker/cpu/moe.py: routing, the
same kernel, the weighted sum), as the one-call step does; bfloat16 activations loop over the
experts in Python (gpu_worker/cpu/linear.py), and dtypes the kernel does not take go to torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu_worker.cpu import linear
from gpu_worker.cpu import moe as cpu_moe
from gpu_worker.cpu.moe import MoEExperts
from gpu_worker.cpu.one_call_step import Keep
from gpu_worker.layers.fused_moe import CKernelExperts, FloatMoEMethod, FusedMoE, moe_c_experts


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] @ weight.T (+ bias): float32 by linear.c's GEMM (any rows, each output
    the same bits whatever the rows beside it: moe.c's kernel for float32 experts); bfloat16
    by linear.c's few-row kernel at most MAX_ROWS rows at a time."""
    y = linear.linear_gemm(x, weight, bias)  # None but for float32
    if y is not None:
        return y
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
    """Float experts [E, out, in] on the CPU (see the module docstring)."""

    name = "cpu_float"

    def _runs_moe_c(self) -> bool:
        return True

    def one_call_experts(self, layer: FusedMoE, keep: Keep) -> MoEExperts | None:
        w13 = layer.w13_weight
        if w13.dtype not in (torch.float32, torch.bfloat16) or layer.w2_weight.dtype != w13.dtype:
            return None
        kind = cpu_moe.KIND_BF16 if w13.dtype == torch.bfloat16 else cpu_moe.KIND_F32
        return moe_c_experts(layer, kind, keep)

    def gate_up(self, layer: FusedMoE, expert: int, x: torch.Tensor) -> torch.Tensor:
        bias = None if layer.w13_bias is None else layer.w13_bias[expert]
        return rows_linear(x, layer.w13_weight[expert], bias)

    def down(self, layer: FusedMoE, expert: int, x: torch.Tensor) -> torch.Tensor:
        bias = None if layer.w2_bias is None else layer.w2_bias[expert]
        return rows_linear(x, layer.w2_weight[expert], bias)
