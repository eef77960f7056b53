"""Triton kernels of the worker's GPU path, one folder per kernel.

Each folder holds `kernel.py` (the `@triton.jit` code and one launcher that asserts shapes,
dtypes and strides) beside `reference.py` (the same computation in plain float32 torch, the
ground truth of the tests). Importing this package, or a kernel's `reference`, never imports
triton: only `kernel.py` does, so the torch-only CPU path runs without triton installed.

On the CPU the kernels run under Triton's interpreter: `TRITON_INTERPRET=1` must be set
before any `kernel.py` is imported (triton reads it when `@triton.jit` decorates).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

KERNEL_NAMES = (
    "kv_store",
    "paged_decode",
    "extend_attention",
    "rmsnorm",
    "rotary",
    "gguf_matmul",
    "int8_matmul",
    "lora",
)


def triton_available() -> bool:
    """Whether `import triton` would succeed, without importing it."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Triton runs kernels in its Python interpreter (CPU tensors) rather than compiling."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs need IEEE dots: Triton's default TF32 would cost ~1e-3 relative error."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_device(*tensors: torch.Tensor) -> None:
    """Every tensor on one device, and that device is CUDA unless the interpreter runs."""
    devices = {t.device for t in tensors}
    assert len(devices) == 1, f"tensors on several devices: {devices}"
    device = devices.pop()
    assert device.type == "cuda" or interpreting(), (
        f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 on the CPU), got {device}"
    )


@functools.cache
def _cuda_sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 0 elsewhere (the interpreter)."""
    if device.type != "cuda":
        return 0
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


def decode_split_k(num_tiles: int, k_steps: int, num_sms: int) -> int:
    """How many K ranges a few-row (decode) GEMM of `num_tiles` output tiles and `k_steps`
    K steps splits into: enough programs for ~2 per SM, each range >= 4 steps, at most 16.
    A weight-bound GEMV of a narrow layer (N / BLOCK_N tiles) otherwise leaves SMs idle.
    1 without SMs (the interpreter)."""
    return max(1, min(2 * num_sms // max(1, num_tiles), k_steps // 4, 16))
