"""GGUF block-quantized weights (Q4_0 ... Q6_K) served as the file stores them.

The layer keeps each shard's bytes (uint8 [rows, row_bytes]) as parameters `weight` (shard
0) and `weight_1`, `weight_2`... (a fused layer whose parts have different types); the
method keeps the shards' types and rows. The kernel is chosen once, when the method is built
(triton imported only when asked for):

    cpu     the C kernels of gpu_worker/cpu/gguf.py (activations quantized per row)
    triton  gpu_worker/kernels/gguf_matmul (dequantized tiles in the GEMM), CUDA
    torch   the weight dequantized once at load (gguf-py), a float matmul: the reference
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from gpu_worker.cpu import gguf as cpu_gguf
from gpu_worker.cpu import one_call_descriptors
from gpu_worker.cpu.one_call_descriptors import DecodeLinear, Keep
from gpu_worker.layers.linear import Linear, set_parameter
from gpu_worker.layers.linear_methods.weights import CheckpointWeight, GGUFWeight


def dequantize_weight(weight: GGUFWeight) -> torch.Tensor:
    """The whole weight as float32 [out, in], by gguf-py's own dequantize (the reader's)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    parts = [
        dequantize(s.data.numpy(), GGMLQuantizationType(s.qtype)).reshape(s.rows, -1)
        for s in weight.shards
    ]
    return torch.from_numpy(np.ascontiguousarray(np.concatenate(parts), dtype=np.float32))


def shard_names(count: int) -> list[str]:
    return ["weight"] + [f"weight_{i}" for i in range(1, count)]


# y [..., rows] = x [..., in] @ W.T for one shard's bytes w, its ggml type and rows
ShardMatmul = Callable[[torch.Tensor, torch.Tensor, int, int, int], torch.Tensor]


def _cpu_matmul(x: torch.Tensor, w: torch.Tensor, qtype: int, rows: int, n_in: int) -> torch.Tensor:
    return cpu_gguf.gguf_linear(x, w, qtype, rows, n_in, None)


def _shard_matmul(kernel: str) -> ShardMatmul | None:
    """The kernel function of `kernel`; None for "torch" (a float weight, F.linear)."""
    if kernel == "torch":
        return None
    if kernel == "cpu":
        return _cpu_matmul
    if kernel == "triton":
        from gpu_worker.kernels.gguf_matmul.kernel import gguf_matmul

        def triton(
            x: torch.Tensor, w: torch.Tensor, qtype: int, rows: int, n_in: int
        ) -> torch.Tensor:
            return gguf_matmul(x.reshape(-1, n_in), w, qtype, rows, n_in).view(*x.shape[:-1], rows)

        return triton
    raise ValueError(f"unknown GGUF kernel {kernel!r} (cpu, triton or torch)")


class GGUFLinearMethod:
    """A GGUF-quantized weight (see the module docstring); one instance per layer."""

    name = "gguf"

    def __init__(self, kernel: str, dtype: torch.dtype) -> None:
        self._matmul = _shard_matmul(kernel)
        self.kernel = kernel
        self.dtype = dtype
        self.qtypes: tuple[int, ...] = ()
        self.rows: tuple[int, ...] = ()

    def load_weights(
        self, layer: Linear, weight: CheckpointWeight, bias: torch.Tensor | None
    ) -> None:
        if not isinstance(weight, GGUFWeight):
            raise TypeError(f"the gguf linear method takes GGUF blocks, got {type(weight)}")
        if (weight.out_features, weight.in_features) != (layer.out_features, layer.in_features):
            raise ValueError(
                f"GGUF weight [{weight.out_features}, {weight.in_features}] does not fit a "
                f"layer [{layer.out_features}, {layer.in_features}]"
            )
        self.qtypes = tuple(s.qtype for s in weight.shards)
        self.rows = tuple(s.rows for s in weight.shards)
        set_parameter(layer, "bias", bias)
        if self._matmul is None:  # the reference: a float weight
            set_parameter(layer, "weight", dequantize_weight(weight).to(self.dtype))
            return
        for name, shard in zip(shard_names(len(weight.shards)), weight.shards, strict=True):
            set_parameter(layer, name, shard.data.contiguous())

    def process_weights_after_loading(self, layer: Linear) -> None:
        pass

    def shards(self, layer: Linear) -> list[torch.Tensor]:
        """Each shard's bytes, in row order."""
        return [layer.get_parameter(n) for n in shard_names(len(self.qtypes))]

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        matmul = self._matmul
        if matmul is None:
            return F.linear(x, layer.weight, layer.bias)
        n_in = layer.in_features
        parts = [matmul(x, w, q, rows, n_in) for w, q, rows in self._each(layer)]
        y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        return y if layer.bias is None else y + layer.bias

    def _each(self, layer: Linear) -> list[tuple[torch.Tensor, int, int]]:
        return list(zip(self.shards(layer), self.qtypes, self.rows, strict=True))

    def one_call_linear(self, layer: Linear, keep: Keep) -> DecodeLinear | None:
        if self._matmul is not _cpu_matmul:  # the C loop runs gguf.c's arithmetic only
            return None
        return one_call_descriptors.gguf_linear(self._each(layer))

    def extra_bytes(self, layer: Linear) -> int:
        return 0

    @property
    def storage(self) -> str:
        from gguf import GGMLQuantizationType

        return "gguf:" + "+".join(sorted({GGMLQuantizationType(q).name for q in self.qtypes}))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.storage.removeprefix('gguf:')}, kernel={self.kernel})"
