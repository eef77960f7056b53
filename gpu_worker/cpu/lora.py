"""Batched LoRA deltas on the CPU (lora.c): each token's adapter update added into a linear
layer's output in place, for a step whose tokens use several adapters and the base model.

`LoraLinearMethod` (gpu_worker/lora/layer.py) calls `lora_add` after its base method when its
kernel is "cpu"; the one-call step runs the same C function inside its loop
(one_call_step.c includes lora.c), so both paths get the same bits. x is fed in float32; y is
float32 or bfloat16 (rounded once after the add); the adapter weights float32 or bfloat16.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from gpu_worker.cpu.build import KernelLibrary

SOURCE = Path(__file__).with_name("lora.c")
INCLUDES = (Path(__file__).with_name("bf16.h"),)


def _declare(lib: ctypes.CDLL) -> None:
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.lora_add.restype = i
    lib.lora_add.argtypes = [p, i, i, p, p, i, i, i, p, i, p, i, p, i, i]


_LIBRARY = KernelLibrary(SOURCE, _declare, "CPU LoRA kernel", INCLUDES)


def load() -> ctypes.CDLL | None:
    """The kernel library (built on first use), or None when it cannot be had."""
    return _LIBRARY.load()


def slice_bounds_tensor(slice_bounds: list[int]) -> torch.Tensor:
    """A layer's output slice bounds as the int32 tensor the kernels read."""
    return torch.tensor(slice_bounds, dtype=torch.int32)


def lora_add(
    y: torch.Tensor,  # [T, out] float32 or bfloat16, contiguous: updated in place
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [S, num_slices, R, in] float32 or bfloat16, contiguous
    lora_b: torch.Tensor,  # [S, out, R], lora_a's dtype, contiguous
    bounds: torch.Tensor,  # [num_slices + 1] int32: slice_bounds_tensor's
    token_slots: torch.Tensor,  # [T] int32, -1: none
) -> bool:
    """y += each token's LoRA delta by the C kernel; False (y untouched) when the library
    cannot be had. Raises ValueError for inputs outside the contract."""
    lib = load()
    if lib is None:
        return False
    num_loras, num_slices, rank, in_features = lora_a.shape
    tokens, out = y.shape
    if (
        x.shape != (tokens, in_features)
        or lora_b.shape != (num_loras, out, rank)
        or lora_b.dtype != lora_a.dtype
        or lora_a.dtype not in (torch.float32, torch.bfloat16)
        or y.dtype not in (torch.float32, torch.bfloat16)
        or not (y.is_contiguous() and lora_a.is_contiguous() and lora_b.is_contiguous())
        or bounds.dtype != torch.int32
        or bounds.numel() != num_slices + 1
        or token_slots.dtype != torch.int32
        or token_slots.numel() != tokens
    ):
        raise ValueError(
            f"lora_add: y {tuple(y.shape)} {y.dtype}, x {tuple(x.shape)}, "
            f"a {tuple(lora_a.shape)} {lora_a.dtype}, b {tuple(lora_b.shape)} {lora_b.dtype}, "
            f"bounds {tuple(bounds.shape)}, slots {tuple(token_slots.shape)}"
        )
    xf = x.to(torch.float32).contiguous()
    slots = token_slots.contiguous()
    code = lib.lora_add(
        xf.data_ptr(), tokens, in_features,
        lora_a.data_ptr(), lora_b.data_ptr(), int(lora_a.dtype == torch.bfloat16),
        num_slices, rank, bounds.data_ptr(), out, slots.data_ptr(), num_loras,
        y.data_ptr(), int(y.dtype == torch.bfloat16), torch.get_num_threads(),
    )  # fmt: skip
    if code == 1:
        raise ValueError(f"lora_add: a slot outside [-1, {num_loras}) or bad bounds {bounds}")
    if code != 0:
        raise MemoryError("lora_add: out of memory")
    return True
