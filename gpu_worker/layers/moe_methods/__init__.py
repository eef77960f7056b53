"""The MoE methods (gpu_worker/layers/fused_moe.py's pattern) beside the torch reference:
CPU float, GGUF and int8 experts, each calling the kernels its linear counterpart calls
(gpu_worker/layers/linear_methods/), MXFP4 experts (gpt-oss as shipped) by their own kernel,
and float experts on CUDA by the Triton fused MoE.
`moe_method` picks one per layer at load."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpu_worker.layers.fused_moe import ExpertWeights, FloatMoEMethod, MoEMethod
from gpu_worker.layers.linear_methods.weights import GGUFWeight, Int8Weight, MXFP4Weight

if TYPE_CHECKING:
    from gpu_worker.layers.kernel_choice import KernelChoice


def moe_method(kernels: KernelChoice, experts: ExpertWeights) -> MoEMethod:
    """A new method object for one MoE layer whose checkpoint experts are `experts` (every
    expert's weights of one kind), with the kernels of `kernels`."""
    first = experts.gate_up[0]
    if isinstance(first, GGUFWeight):
        from gpu_worker.layers.moe_methods.gguf import GGUFMoEMethod

        return GGUFMoEMethod(kernels.quantized_kernel, kernels.dtype)
    if isinstance(first, MXFP4Weight):
        from gpu_worker.layers.moe_methods.mxfp4 import MXFP4MoEMethod

        return MXFP4MoEMethod(kernels.quantized_kernel)  # "cpu", "triton" or "torch"
    if isinstance(first, Int8Weight):
        from gpu_worker.layers.moe_methods.int8 import Int8MoEMethod

        return Int8MoEMethod(kernels.quantized_kernel)
    if kernels.cpu_linears:
        from gpu_worker.layers.moe_methods.cpu_float import CpuFloatMoEMethod

        return CpuFloatMoEMethod()
    if kernels.triton_linears:  # CUDA: the Triton fused MoE
        from gpu_worker.layers.moe_methods.triton import TritonMoEMethod

        return TritonMoEMethod()
    return FloatMoEMethod()
