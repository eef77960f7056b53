"""The layer kernels a model calls for its norms, rotary and activation, chosen once at load.

    TorchLayerOps   plain torch, HF's arithmetic: the reference, and the path everywhere
    CpuLayerOps     ops_cpu.py: the C kernels of gpu_worker/cpu/layers.c (float32, bfloat16)
    TritonLayerOps  ops_triton.py: the Triton kernels of gpu_worker/kernels/ (CUDA)

The model's modules hold the ops object they were built with (`RMSNorm.ops`, ...) and call
it; they name no kernel. `rope` is what `rotate` needs for the step's tokens, built once per
step and opaque to the model: torch gathers cos/sin per token, the kernels take the tables and
the positions and gather as they rotate.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

Rope = tuple[torch.Tensor, ...]


class LayerOps(Protocol):
    """Norms, residual add, rotary, SwiGLU activation and the shared expert's gate (see the
    module docstring)."""

    name: str

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x / rms(x) * weight over the last dimension."""
        ...

    def add_rms_norm(
        self, h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + h) * weight, x + h): the residual stream's next norm and itself."""
        ...

    def rope(
        self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
    ) -> Rope:
        """What `rotate` needs for the step's tokens, from the [max_positions, rotary_dim // 2]
        cos/sin tables (rotary_dim <= head_dim: the first rotary_dim dims of a head rotate)."""
        ...

    def rotate(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        """x [T, heads, head_dim] rotated pair by pair (neox layout: pairs (i, i + d/2) of its
        first d = rotary_dim dims, the rest unchanged); may rotate x in place."""
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up = [gate | up] on the last dimension."""
        ...

    def add_gated(
        self, out: torch.Tensor, shared: torch.Tensor, gate: torch.Tensor
    ) -> torch.Tensor:
        """out + sigmoid(gate [T, 1]) * shared [T, H]: Qwen2-MoE's gated shared expert."""
        ...


def rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated by per-token cos/sin [T, 1, rotary_dim // 2]: HF's
    rotate_half on the first rotary_dim dims, the rest passed through (Phi-3's partial rotary)."""
    half = cos.shape[-1]
    if 2 * half == x.shape[-1]:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


class TorchLayerOps:
    """Plain torch, computed as HF computes it (norms in float32, cast back)."""

    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x.to(dtype)

    def add_rms_norm(
        self, h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + h
        return self.rms_norm(x, weight, eps), x

    def rope(
        self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
    ) -> Rope:
        return cos[positions].unsqueeze(1).to(dtype), sin[positions].unsqueeze(1).to(dtype)

    def rotate(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        cos, sin = rope
        return rotate_neox(x, cos, sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def add_gated(
        self, out: torch.Tensor, shared: torch.Tensor, gate: torch.Tensor
    ) -> torch.Tensor:
        return out + torch.sigmoid(gate) * shared

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


TORCH_OPS = TorchLayerOps()
