"""A Llama layer's norms, rotary and SwiGLU activation by the C kernels of layers.c.

The functions behind the CPU's layer ops (`CpuLayerOps`, gpu_worker/layers/ops_cpu.py),
chosen at load by gpu_worker/layers/kernel_choice.py, as the Triton kernels are on CUDA:

    rms_norm      one call instead of ~8 torch ops
    add_rms_norm  the residual add fused into the post-attention norm
    rope/rotate   q and k rotated in place, cos/sin read by position
    silu_mul      silu(gate) * up in one call

Float32 and bfloat16 CPU models (`load` returns None when the library cannot be built); in
bf16 the kernels round where the torch ops round (layers.c). A decode step of one sequence
runs ~60 torch ops per layer whose dispatch costs more than their arithmetic; this leaves ~25.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from gpu_worker.cpu.build import KernelLibrary

SOURCE = Path(__file__).with_name("layers.c")


def _declare(lib: ctypes.CDLL) -> None:
    p, i, f, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_int64
    lib.rms_norm.restype = None
    lib.rms_norm.argtypes = [p, p, p, f, p, p, i, i, i, i]
    lib.rotary_neox.restype = None
    lib.rotary_neox.argtypes = [p, p, p, p, i, i, i, i, i64, i, i]
    lib.silu_mul.restype = None
    lib.silu_mul.argtypes = [p, p, i, i, i, i]


_LIBRARY = KernelLibrary(
    SOURCE, _declare, "CPU layer kernels", (Path(__file__).with_name("bf16.h"),)
)


def load() -> ctypes.CDLL | None:
    """The kernel library (built on first use), or None when it cannot be had."""
    return _LIBRARY.load()


def _lib_loaded() -> ctypes.CDLL:
    lib = _LIBRARY.load()
    assert lib is not None, "the layer ops load the library before they are used"
    return lib


def _is_bf16(x: torch.Tensor) -> int:
    return int(x.dtype == torch.bfloat16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rmsnorm(x) * weight over the last dimension, x [..., dim] (weight of x's dtype)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    _norm(x, None, weight, eps, out, None)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) * weight, x + residual): the new residual stream and its norm
    in one pass."""
    x, residual = x.contiguous(), residual.contiguous()
    out, total = torch.empty_like(x), torch.empty_like(x)
    _norm(x, residual, weight, eps, out, total)
    return out, total


def _norm(
    x: torch.Tensor,
    add: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    total: torch.Tensor | None,
) -> None:
    dim = x.shape[-1]
    _lib_loaded().rms_norm(
        x.data_ptr(),
        add.data_ptr() if add is not None else None,
        weight.data_ptr(),
        eps,
        out.data_ptr(),
        total.data_ptr() if total is not None else None,
        x.numel() // dim,
        dim,
        torch.get_num_threads(),
        _is_bf16(x),
    )


def rotary_neox(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """x [tokens, heads, head_dim] (heads contiguous, any token stride) rotated in place;
    cos/sin float32 tables [positions, rotary_dim // 2] whatever x's dtype: each head's first
    rotary_dim dims rotate, the rest are left as they are."""
    tokens, heads, head_dim = x.shape
    rotary_dim = 2 * cos.shape[1]
    assert x.stride(2) == 1 and x.stride(1) == head_dim, "heads must be contiguous per token"
    assert positions.dtype == torch.int64 and positions.is_contiguous()
    assert rotary_dim <= head_dim and sin.shape == cos.shape, f"tables {tuple(cos.shape)}"
    assert cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
    _lib_loaded().rotary_neox(
        x.data_ptr(),
        positions.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        tokens,
        heads,
        head_dim,
        rotary_dim,
        x.stride(0),
        torch.get_num_threads(),
        _is_bf16(x),
    )
    return x


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate_up[:, :n]) * gate_up[:, n:] for gate_up [rows, 2n]."""
    rows, two_n = gate_up.shape
    gate_up = gate_up.contiguous()
    out = torch.empty(rows, two_n // 2, dtype=gate_up.dtype)
    _lib_loaded().silu_mul(
        gate_up.data_ptr(),
        out.data_ptr(),
        rows,
        two_n // 2,
        torch.get_num_threads(),
        _is_bf16(gate_up),
    )
    return out
