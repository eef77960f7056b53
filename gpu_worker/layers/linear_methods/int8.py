"""int8 W8A8 weights: int8 [out, in] with a float32 scale per output row, activations
quantized per row (per token, never per batch) to int8 with their own scale.

    cpu     the C kernels of gpu_worker/cpu/int8.py (VNNI / AVX2 integer dot products;
            oneDNN's int8 GEMM on a packed copy for many rows, with the same epilogue)
    triton  gpu_worker/kernels/int8_matmul, CUDA
    torch   the same arithmetic in torch (gpu_worker/cpu/int8.py's torch path)

The kernel is chosen once, when the method is built (triton imported only when asked for).
Each path gives a row the same bits whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gpu_worker.cpu import int8, one_call_descriptors
from gpu_worker.cpu.one_call_descriptors import DecodeLinear, Keep
from gpu_worker.layers.linear import Linear, set_parameter
from gpu_worker.layers.linear_methods.weights import CheckpointWeight, Int8Weight


class Int8LinearMethod:
    """An int8 W8A8 weight (see the module docstring); one instance per layer."""

    name = "int8"

    def __init__(self, kernel: str, dtype: torch.dtype) -> None:
        self._apply = self._choose_kernel(kernel)
        self.kernel = kernel
        self.dtype = dtype
        self.packed: torch.Tensor | None = None  # oneDNN's copy for many rows (cpu)

    def load_weights(
        self, layer: Linear, weight: CheckpointWeight, bias: torch.Tensor | None
    ) -> None:
        if not isinstance(weight, Int8Weight):
            raise TypeError(f"the int8 linear method takes int8 weights, got {type(weight)}")
        if tuple(weight.weight.shape) != (layer.out_features, layer.in_features):
            raise ValueError(
                f"int8 weight {list(weight.weight.shape)} does not fit a layer "
                f"[{layer.out_features}, {layer.in_features}]"
            )
        set_parameter(layer, "weight", weight.weight.contiguous())
        set_parameter(layer, "weight_scale", weight.scale.to(torch.float32).contiguous())
        set_parameter(layer, "bias", bias)

    def process_weights_after_loading(self, layer: Linear) -> None:
        if self._apply == self._apply_cpu and layer.weight.is_cpu:  # (oneDNN packs host memory)
            self.packed = int8.pack_weight(layer.weight)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return self._apply(layer, x)

    def _choose_kernel(self, kernel: str) -> Callable[[Linear, torch.Tensor], torch.Tensor]:
        if kernel == "cpu":
            return self._apply_cpu
        if kernel == "torch":
            return self._apply_torch
        if kernel == "triton":
            from gpu_worker.kernels.int8_matmul.kernel import int8_matmul

            def triton(layer: Linear, x: torch.Tensor) -> torch.Tensor:
                scale = layer.get_parameter("weight_scale")
                flat = x.reshape(-1, layer.in_features)
                y = int8_matmul(flat, layer.weight, scale).view(*x.shape[:-1], layer.out_features)
                return y if layer.bias is None else y + layer.bias

            return triton
        raise ValueError(f"unknown int8 kernel {kernel!r} (cpu, triton or torch)")

    def _apply_cpu(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        scale = layer.get_parameter("weight_scale")
        return int8.int8_linear(x, layer.weight, scale, layer.bias, self.packed)

    def _apply_torch(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        scale = layer.get_parameter("weight_scale")
        flat = x.reshape(-1, layer.in_features).to(torch.float32)
        y = int8.int8_linear_torch(flat, layer.weight, scale, layer.bias)
        return y.to(x.dtype).view(*x.shape[:-1], layer.out_features)

    def one_call_linear(self, layer: Linear, keep: Keep) -> DecodeLinear | None:
        if self._apply != self._apply_cpu:  # the C loop runs int8.c's arithmetic only
            return None
        return one_call_descriptors.int8_linear(layer.weight, layer.get_parameter("weight_scale"))

    def extra_bytes(self, layer: Linear) -> int:
        # the packed copy: about the int8 weight and its scales
        return layer.weight.numel() + 4 * layer.out_features if self.packed is not None else 0

    storage = "int8"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(kernel={self.kernel})"
