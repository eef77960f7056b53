"""Float32 and bfloat16 weights on the CPU, by the kernels of gpu_worker/cpu/linear.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu_worker.cpu import linear, one_call_descriptors
from gpu_worker.cpu.one_call_descriptors import DecodeLinear, Keep
from gpu_worker.layers.linear import FloatLinearMethod, Linear
from gpu_worker.layers.linear_methods.weights import CheckpointWeight


class CpuFloatLinearMethod:
    """A float32 or bfloat16 weight on the CPU: the C kernel for a few rows, oneDNN on the
    weight pre-packed once (when `pack` and the dtype allows) for more, torch otherwise.
    One instance per layer: it holds that layer's packed copy."""

    name = "cpu_float"

    def __init__(self, pack: bool = True) -> None:
        self.pack = pack
        self.packed: torch.Tensor | None = None

    def load_weights(
        self, layer: Linear, weight: CheckpointWeight, bias: torch.Tensor | None
    ) -> None:
        FloatLinearMethod().load_weights(layer, weight, bias)

    def process_weights_after_loading(self, layer: Linear) -> None:
        if self.pack and layer.weight.is_cpu and linear.can_pack(layer.weight.dtype):
            self.packed = linear.pack_weight(layer.weight)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        y = linear.linear_small(x, layer.weight, layer.bias)
        if y is not None:
            return y
        if self.packed is not None and x.dtype == layer.weight.dtype:
            return linear.linear_packed(x, self.packed, layer.bias)
        return F.linear(x, layer.weight, layer.bias)

    def one_call_linear(self, layer: Linear, keep: Keep) -> DecodeLinear | None:
        return one_call_descriptors.float_linear(layer.weight)

    def extra_bytes(self, layer: Linear) -> int:
        # the packed copy: as large as the weight
        return layer.weight.numel() * layer.weight.element_size() if self.packed is not None else 0

    storage = ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(packed={self.packed is not None})"
