"""int8 W8A8 weights: int8 [out, in] with a float32 scale per output row, activations
quantized per row (per token, never per batch) to int8 with their own scale.

    cpu     the C kernels of gpu_worker/cpu/int8.py (VNNI / AVX2 integer dot products)
    triton  gpu_worker/kernels/int8_matmul, CUDA
    torch   the same arithmetic in torch: the reference
"""

from __future__ import annotations

import torch

from gpu_worker.linear_methods.weights import CheckpointWeight, Int8Weight
from gpu_worker.models.linear import Linear, set_parameter


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of x [..., in] as int8 values and a float32 scale [..., 1] (symmetric:
    scale = absmax / 127)."""
    xf = x.to(torch.float32)
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / 127.0
    return torch.round(xf / scale).clamp(-127, 127).to(torch.int8), scale


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [out, in] as int8 [out, in] and a float32 scale [out] per output row
    (symmetric: scale = absmax / 127), as LLM Compressor's W8A8 channel scheme."""
    values, scale = quantize_rows(weight)
    return values, scale.squeeze(-1)


def int8_reference(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x @ (weight * scale).T (+ bias) with x quantized per row, in float32 arithmetic."""
    xq, xs = quantize_rows(x)
    y = (xq.to(torch.float32) @ weight.to(torch.float32).T) * xs * scale.to(torch.float32)
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)


class Int8LinearMethod:
    """An int8 W8A8 weight (see the module docstring); one instance per layer."""

    name = "int8"

    def __init__(self, kernel: str, dtype: torch.dtype) -> None:
        assert kernel in ("cpu", "triton", "torch"), kernel
        self.kernel = kernel
        self.dtype = dtype

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
        pass

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        scale = layer.get_parameter("weight_scale")
        if self.kernel == "cpu":
            from gpu_worker.cpu import int8

            return int8.int8_linear(x, layer.weight, scale, layer.bias)
        if self.kernel == "triton":
            from gpu_worker.kernels.int8_matmul.kernel import int8_matmul

            flat = x.reshape(-1, layer.in_features)
            y = int8_matmul(flat, layer.weight, scale).view(*x.shape[:-1], layer.out_features)
            return y if layer.bias is None else y + layer.bias
        return int8_reference(x, layer.weight, scale, layer.bias)

    def weight_bytes(self, layer: Linear) -> int:
        return layer.weight.numel() + 4 * layer.out_features

    def extra_bytes(self, layer: Linear) -> int:
        return 0

    storage = "int8"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(kernel={self.kernel})"
