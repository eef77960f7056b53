"""int8 W8A8 experts (symmetric per output row; activations quantized per row) by the int8
linear kernels (gpu_worker/cpu/int8.py; torch's exact path for the "torch" kernel; the
Triton W8A8 GEMM on CUDA): a row's result is the same bits in any group. Stacked as
`w13_weight` int8 [E, 2 * width, hidden] with `w13_scale` [E, 2 * width], and `w2_weight` /
`w2_scale`."""

from __future__ import annotations

import torch

from gpu_worker.cpu import int8
from gpu_worker.cpu import moe as cpu_moe
from gpu_worker.cpu.moe import MoEExperts
from gpu_worker.cpu.one_call_descriptors import Keep
from gpu_worker.layers.fused_moe import ExpertWeights, FusedMoE, check_shape
from gpu_worker.layers.linear import set_parameter
from gpu_worker.layers.linear_methods.weights import CheckpointWeight, Int8Weight
from gpu_worker.layers.moe_methods.c_kernel import ProjectedExperts, moe_c_experts


def _int8(parts: list[CheckpointWeight], what: str) -> list[Int8Weight]:
    out = [p for p in parts if isinstance(p, Int8Weight)]
    if len(out) != len(parts):
        raise TypeError(f"the int8 MoE method takes int8 {what} experts, got {type(parts[0])}")
    return out


class Int8MoEMethod(ProjectedExperts):
    """int8 experts (see the module docstring); one instance per layer."""

    name = "int8"

    def __init__(self, kernel: str) -> None:
        if kernel not in ("cpu", "torch", "triton"):
            raise ValueError(f"unknown int8 kernel {kernel!r} (cpu, triton or torch)")
        self.kernel = kernel

    def load_weights(self, layer: FusedMoE, experts: ExpertWeights) -> None:
        for prefix, parts, what in (
            ("w13", experts.gate_up, "gate/up"),
            ("w2", experts.down, "down"),
        ):
            weights = _int8(parts, what)
            w = torch.stack([x.weight for x in weights]).contiguous()
            check_shape(layer, f"{prefix}_weight", tuple(w.shape))
            set_parameter(layer, f"{prefix}_weight", w)
            scale = torch.stack([x.scale.to(torch.float32) for x in weights]).contiguous()
            set_parameter(layer, f"{prefix}_scale", scale)
        set_parameter(layer, "w13_bias", experts.gate_up_bias)
        set_parameter(layer, "w2_bias", experts.down_bias)

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        pass

    def one_call_experts(self, layer: FusedMoE, keep: Keep) -> MoEExperts | None:
        if self.kernel != "cpu":  # moe.c runs int8.c's arithmetic only
            return None
        scales = (layer.get_parameter("w13_scale"), layer.get_parameter("w2_scale"))
        return moe_c_experts(layer, cpu_moe.KIND_INT8, keep, scales=scales)

    def _project(self, layer: FusedMoE, prefix: str, expert: int, x: torch.Tensor) -> torch.Tensor:
        w = layer.get_parameter(f"{prefix}_weight")[expert]
        scale = layer.get_parameter(f"{prefix}_scale")[expert]
        bias_all = layer.w13_bias if prefix == "w13" else layer.w2_bias
        bias = None if bias_all is None else bias_all[expert].to(torch.float32)
        if self.kernel == "cpu":
            return int8.int8_linear(x, w, scale, bias)
        if self.kernel == "triton":  # CUDA: the W8A8 Triton GEMM per expert group
            from gpu_worker.kernels.int8_matmul.kernel import int8_matmul

            y = int8_matmul(x.contiguous(), w, scale)
            return y if bias is None else y + bias.to(y.dtype)
        y = int8.int8_linear_torch(x.to(torch.float32), w, scale, bias)
        return y.to(x.dtype)

    storage = "int8"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(kernel={self.kernel})"
