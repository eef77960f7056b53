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
    "fused_moe",
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


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    out: torch.Tensor,  # like q
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int32
    num_reqs: int,
    kv_cache_dtype: str = "auto",
) -> None:
    """The checks every paged-attention launcher makes (paged_decode, extend_attention): the
    cache contiguous; q of its dtype and head_dim, its heads a multiple of the KV heads,
    head_dim contiguous; out like q; one block-table row per request, rows contiguous."""
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, f"kv_cache {tuple(kv_cache.shape)}"
    assert kv_cache.is_contiguous(), "kv_cache must be contiguous"
    from gpu_worker.kv_quant import KVFormat

    fmt = KVFormat.create(kv_cache_dtype, q.dtype)
    num_kv_heads, head_dim = kv_cache.shape[3], fmt.head_dim(kv_cache.shape[4])
    assert q.dim() == 3 and q.shape[2] == head_dim, f"q {tuple(q.shape)}, head_dim {head_dim}"
    assert q.shape[1] % num_kv_heads == 0, f"{q.shape[1]} heads, {num_kv_heads} KV heads"
    assert q.stride(2) == 1, "q needs a contiguous head_dim"
    want = fmt.storage_dtype
    assert kv_cache.dtype == want, f"q is {q.dtype}, cache {kv_cache.dtype} ({kv_cache_dtype})"
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1, "bad out"
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_reqs, "bad block_tables"
    assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1, "bad block_tables"


def matmul_out(x: torch.Tensor, k: int, n: int, out: torch.Tensor | None) -> torch.Tensor:
    """The checks of a quantized GEMM launcher (gguf_matmul, int8_matmul) on x [M, K] (float,
    rows dense) and out [M, N] (x's dtype, rows dense; made when None); returns out."""
    assert x.dim() == 2 and x.shape[1] == k and x.stride(1) == 1, "x must be [M, K], rows dense"
    assert x.dtype in FLOAT_DTYPES, f"x is {x.dtype}"
    m = x.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    assert out.shape == (m, n) and out.dtype == x.dtype and out.stride(1) == 1, "bad out"
    return out


def split_k_ranges(
    split_k: int | None, m: int, num_tiles: int, k: int, block_k: int, device: torch.device
) -> tuple[int, int]:
    """(ranges, K per range) of a quantized GEMM over K in steps of block_k: `split_k` ranges
    as asked, or for decode-sized m (<= 16) `decode_split_k`'s (1 otherwise), none empty."""
    k_steps = -(-k // block_k)
    if split_k is None:
        split_k = decode_split_k(num_tiles, k_steps, sm_count(device)) if m <= 16 else 1
    per_split = -(-k_steps // split_k) * block_k
    return -(-k // per_split), per_split


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
