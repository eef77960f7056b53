"""The layer ops (gpu_worker/layers/ops.py) on the CPU: the C kernels of
gpu_worker/cpu/layers.py (layers.c) and moe.c's shared-expert gate (gpu_worker/cpu/moe.py),
float32 and bfloat16 models; chosen at load by gpu_worker/layers/kernel_choice.py."""

from __future__ import annotations

import torch

from gpu_worker.cpu import layers
from gpu_worker.cpu import moe as cpu_moe
from gpu_worker.layers.ops import TORCH_OPS, Rope


class CpuLayerOps:
    """The layer ops (gpu_worker/layers/ops.py) by the C kernels of layers.c: float32
    and bfloat16 activations; the rope is (cos table, sin table, positions), gathered by the
    rotary kernel itself."""

    name = "cpu"

    def __init__(self) -> None:
        self._float32_tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return layers.rms_norm(x, weight, eps)

    def add_rms_norm(
        self, h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return layers.add_rms_norm(h, x, weight, eps)

    def rope(
        self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
    ) -> Rope:
        if cos.dtype != torch.float32:  # the kernel reads float32 tables: a bf16 model's, once
            cached = self._float32_tables.get(cos.data_ptr())
            if cached is None:
                cached = self._float32_tables[cos.data_ptr()] = (cos.float(), sin.float())
            cos, sin = cached
        return cos, sin, positions.to(torch.int64).contiguous()

    def rotate(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        cos, sin, positions = rope
        return layers.rotary_neox(x, positions, cos, sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return layers.silu_mul(gate_up)

    def add_gated(
        self, out: torch.Tensor, shared: torch.Tensor, gate: torch.Tensor
    ) -> torch.Tensor:
        # moe.c's, as the one-call step adds it (float32; torch otherwise)
        done = cpu_moe.add_gated(out, shared, gate)
        return TORCH_OPS.add_gated(out, shared, gate) if done is None else done

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def cpu_layer_ops(model_dtype: torch.dtype) -> CpuLayerOps | None:
    """The C layer ops for a CPU model of `model_dtype`, or None where they do not serve it
    (another dtype, or the library cannot be had)."""
    if model_dtype not in (torch.float32, torch.bfloat16) or layers.load() is None:
        return None
    return CpuLayerOps()
