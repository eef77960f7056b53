"""MXFP4 experts (gpt-oss checkpoints as shipped), kept packed and multiplied from the packed
bytes: per expert, gate/up and down as MXFP4Weight (gpu_worker/layers/linear_methods/
weights.py: uint8 blocks of 32 E2M1 values with an E8M0 exponent each), about 4.25 bits a
value, so an expert's bytes are a quarter of bf16's.

The layer holds them stacked over the experts: `w13_weight` uint8 [E, 2 * width, hidden / 32,
16] with `w13_scale` uint8 [E, 2 * width, hidden / 32], `w2_weight` / `w2_scale` likewise
for down, and the float biases. Two kernels:

    "cpu"    mxfp4.c: each selected expert's rows dot the expert's groups unpacked one at a
             time; a row's result is the same bits in any batch. The whole layer runs in
             moe.c's one call (gpu_worker/cpu/moe.py, as the one-call step does) for float32
             activations, else per expert (gpu_worker/cpu/mxfp4.py)
    "triton" CUDA: gpu_worker/kernels/mxfp4_matmul, a GEMM that decodes each 32-value group
             of the packed tile and multiplies it by tl.dot (float32 sums)
    "torch"  the reference (and the path without a compiler or Triton): the selected
             expert's weight dequantized as transformers' integrations/mxfp4.py does
             (`dequantize_mxfp4`), then F.linear

Gate and up stay in the checkpoint's alternate rows (FusedMoE's "swiglu_clamp" reads them so).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu_worker.cpu import moe as cpu_moe
from gpu_worker.cpu import mxfp4 as cpu_mxfp4
from gpu_worker.cpu.moe import MoEExperts
from gpu_worker.cpu.one_call_descriptors import Keep
from gpu_worker.layers.fused_moe import ExpertWeights, FusedMoE, check_shape
from gpu_worker.layers.linear import set_parameter
from gpu_worker.layers.linear_methods.weights import CheckpointWeight, MXFP4Weight
from gpu_worker.layers.moe_methods.c_kernel import ProjectedExperts, moe_c_experts

# E2M1's 16 values by nibble (sign bit 3), as transformers' FP4_VALUES
_POSITIVE = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_VALUES = _POSITIVE + tuple(-v for v in _POSITIVE)


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """blocks uint8 [..., G, 16] and scales uint8 [..., G] as the float weight [..., G * 32]:
    the low nibble of byte i is value 2i, the high one 2i + 1, times 2 ** (scale - 127)."""
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    values = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1)
    values = values.flatten(-2)  # [..., G, 32]
    exponents = scales.to(torch.int32) - 127
    out = torch.ldexp(values, exponents[..., None].to(dtype))
    return out.flatten(-2).to(dtype)


def _mxfp4(parts: list[CheckpointWeight], what: str) -> list[MXFP4Weight]:
    out = [p for p in parts if isinstance(p, MXFP4Weight)]
    if len(out) != len(parts):
        raise TypeError(f"the mxfp4 MoE method takes MXFP4 {what} experts, got {type(parts[0])}")
    return out


class MXFP4MoEMethod(ProjectedExperts):
    """MXFP4 experts (see the module docstring); one instance per layer."""

    name = "mxfp4"
    storage = "mxfp4"

    def __init__(self, kernel: str) -> None:
        self.kernel = kernel

    def load_weights(self, layer: FusedMoE, experts: ExpertWeights) -> None:
        for prefix, parts, what in (
            ("w13", experts.gate_up, "gate/up"),
            ("w2", experts.down, "down"),
        ):
            weights = _mxfp4(parts, what)
            first = weights[0]
            check_shape(
                layer, f"{prefix}_weight", (len(weights), first.out_features, first.in_features)
            )
            blocks = torch.stack([w.blocks for w in weights]).contiguous()
            scales = torch.stack([w.scales for w in weights]).contiguous()
            set_parameter(layer, f"{prefix}_weight", blocks)
            set_parameter(layer, f"{prefix}_scale", scales)
        set_parameter(layer, "w13_bias", experts.gate_up_bias)
        set_parameter(layer, "w2_bias", experts.down_bias)

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        if self.kernel == "cpu" and (
            layer.w13_weight.device.type != "cpu" or cpu_mxfp4.load() is None
        ):
            self.kernel = "torch"  # no compiler (or not on the CPU): the reference
        if self.kernel == "triton" and layer.w13_weight.device.type != "cuda":
            from gpu_worker.kernels import interpreting

            if not interpreting():  # (the interpreter runs the kernel on the CPU: tests)
                self.kernel = "torch"

    def one_call_experts(self, layer: FusedMoE, keep: Keep) -> MoEExperts | None:
        if self.kernel != "cpu":  # moe.c runs mxfp4.c's arithmetic only
            return None
        scales = (layer.get_parameter("w13_scale"), layer.get_parameter("w2_scale"))
        return moe_c_experts(layer, cpu_moe.KIND_MXFP4, keep, scales=scales)

    def _project(self, layer: FusedMoE, prefix: str, expert: int, x: torch.Tensor) -> torch.Tensor:
        blocks = layer.get_parameter(f"{prefix}_weight")[expert]
        scales = layer.get_parameter(f"{prefix}_scale")[expert]
        bias_all = getattr(layer, f"{prefix}_bias")
        bias = None if bias_all is None else bias_all[expert]
        if self.kernel == "cpu":
            y = cpu_mxfp4.linear_rows(x, blocks, scales, bias)
            if y is not None:
                return y
        if self.kernel == "triton":
            from gpu_worker.kernels.mxfp4_matmul.kernel import mxfp4_matmul

            return mxfp4_matmul(x.contiguous(), blocks, scales, bias)
        return F.linear(x, dequantize_mxfp4(blocks, scales, x.dtype), bias)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(kernel={self.kernel})"
