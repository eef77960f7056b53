"""Which kernels run in a model: chosen once, before the model is built, and held by it.

    layer ops     norms, rotary, activation: torch, the CPU's C kernels, or Triton on CUDA
    linear method one per linear layer, from its checkpoint weight (float, GGUF, int8) and
                  this choice: the C kernels on the CPU, Triton on CUDA, torch otherwise
    LoRA kernel   the batched adapter deltas after each targeted linear: the same choice
    one-call step the CPU's whole decode step in one C call, where it takes the model

The model code names none of them (gpu_worker/models/llama.py); the loader asks this object
for each layer's method, and the runner prints what was chosen.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from gpu_worker.cpu.one_call_model import OneCallModel
from gpu_worker.cpu.one_call_step import OneCallStep, one_call_step_for
from gpu_worker.layers.linear import FloatLinearMethod, LinearMethod
from gpu_worker.layers.linear_methods.cpu_float import CpuFloatLinearMethod
from gpu_worker.layers.linear_methods.gguf import GGUFLinearMethod
from gpu_worker.layers.linear_methods.int8 import Int8LinearMethod
from gpu_worker.layers.linear_methods.weights import CheckpointWeight, GGUFWeight, Int8Weight
from gpu_worker.layers.ops import TORCH_OPS, LayerOps

# the quantized checkpoint weights and their methods, built with (kernel, dtype): a new format
# is its method file (gpu_worker/layers/linear_methods/) and one line here
QUANTIZED_METHODS: dict[type, Callable[[str, torch.dtype], LinearMethod]] = {
    GGUFWeight: GGUFLinearMethod,
    Int8Weight: Int8LinearMethod,
}


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """The kernels of one model (see the module docstring)."""

    ops: LayerOps = TORCH_OPS
    # the model's float dtype (activations; float weights; dequantized ones on the torch path)
    dtype: torch.dtype = torch.float32
    # the CPU's C kernels for linears (few rows) and oneDNN pre-packed weights (many rows)
    cpu_linears: bool = False
    cpu_packed_weights: bool = True
    # Triton kernels for quantized linears (CUDA)
    triton_linears: bool = False
    # the CPU's one-call step (beside the C layer ops only), when the model is of a shape it
    # takes
    one_call_step: bool = False

    def linear_method(self, weight: CheckpointWeight) -> LinearMethod:
        """A new method object for one layer whose checkpoint weight is `weight`."""
        quantized = QUANTIZED_METHODS.get(type(weight))
        if quantized is not None:
            return quantized(self.quantized_kernel, self.dtype)
        if self.cpu_linears:
            return CpuFloatLinearMethod(pack=self.cpu_packed_weights)
        return FloatLinearMethod()

    @property
    def quantized_kernel(self) -> str:
        """ "cpu" (C), "triton" (CUDA) or "torch" (dequantize, then a float matmul)."""
        if self.cpu_linears:
            return "cpu"
        return "triton" if self.triton_linears else "torch"

    @property
    def lora_kernel(self) -> str:
        """The batched LoRA kernel of LoraLinearMethod (gpu_worker/lora/layer.py): "cpu"
        (lora.c, also inside the one-call step) beside the C linears, "triton" beside
        the Triton ones (CUDA), "torch" (the reference) otherwise."""
        if self.cpu_linears:
            from gpu_worker.cpu import lora

            if lora.load() is not None:
                return "cpu"
        return "triton" if self.triton_linears else "torch"

    def one_call_step_for(self, model: OneCallModel) -> OneCallStep | None:
        """The model's one-call step, or None (not chosen, or not of a shape it takes)."""
        return one_call_step_for(model) if self.one_call_step else None

    def describe(self) -> str:
        """One line for the start log."""
        return (
            f"layer ops {self.ops.name}, linears {self.quantized_kernel}, "
            f"one-call step {'on' if self.one_call_step else 'off'}"
        )


TORCH_KERNELS = KernelChoice()


def choose_kernels(
    *,
    device: torch.device,
    backend_name: str,
    dtype: torch.dtype,
    cpu_kernels: bool = True,
    cpu_packed_weights: bool = True,
) -> KernelChoice:
    """The kernels for a model on `device` served by the attention backend `backend_name`:
    Triton layers with the triton backend; the C kernels on the CPU with the torch backend
    (unless `cpu_kernels` is off, or the libraries cannot be built); torch otherwise."""
    if backend_name == "triton":
        from gpu_worker.layers.ops_triton import TritonLayerOps

        return KernelChoice(ops=TritonLayerOps(), dtype=dtype, triton_linears=True)
    if device.type != "cpu" or not cpu_kernels or backend_name != "torch":
        return KernelChoice(dtype=dtype)
    from gpu_worker.cpu import linear
    from gpu_worker.layers.ops_cpu import cpu_layer_ops

    ops = cpu_layer_ops(dtype)
    if ops is None or linear.load() is None:
        return KernelChoice(dtype=dtype)
    return KernelChoice(
        ops=ops,
        dtype=dtype,
        cpu_linears=True,
        cpu_packed_weights=cpu_packed_weights,
        one_call_step=True,
    )
