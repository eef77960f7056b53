"""Neox-style rotary embedding in Triton, in place on q and k: one program per token. The
tables' width sets the rotated dims: pairs (i, i + half) for i < half = cos_cache.shape[1], so
a head's dims past 2 * half are not touched (Phi-3's partial rotary)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_worker.kernels import check_device, next_power_of_2


@triton.jit
def _rotate_heads(x_ptr, stride_h, num_heads, cos, sin, half, BLOCK_H: tl.constexpr,
                  BLOCK_HALF: tl.constexpr):  # fmt: skip
    """Rotate every head of one token's row (x_ptr points at the token)."""
    h = tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    mask = (h[:, None] < num_heads) & (i[None, :] < half)
    first = x_ptr + h[:, None] * stride_h + i[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + half, mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * cos[None, :] - x2 * sin[None, :]
    out2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(first, out1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + half, out2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    stride_sin,
    num_q_heads,
    num_k_heads,
    half,
    HAS_K: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t)
    i = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_ptr + pos * stride_cos + i, mask=i < half, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_sin + i, mask=i < half, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, num_q_heads, cos, sin, half, BLOCK_HQ,
                  BLOCK_HALF)  # fmt: skip
    if HAS_K:
        _rotate_heads(k_ptr + t * stride_kt, stride_kh, num_k_heads, cos, sin, half, BLOCK_HK,
                      BLOCK_HALF)  # fmt: skip


def _check_heads(name: str, x: torch.Tensor, num_tokens: int, head_dim: int) -> None:
    assert x.dim() == 3 and x.shape[0] == num_tokens, f"{name} {tuple(x.shape)}"
    assert x.shape[2] == head_dim, f"{name} head_dim {x.shape[2]}"
    assert x.stride(2) == 1, f"{name} needs a contiguous head_dim"


def rotary_embedding(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, num_heads, head_dim], rotated in place (a strided view is fine)
    k: torch.Tensor | None,  # [T, num_kv_heads, head_dim], rotated in place; None: q only
    cos_cache: torch.Tensor,  # [max_positions, rotary_dim // 2], rotary_dim <= head_dim
    sin_cache: torch.Tensor,  # [max_positions, rotary_dim // 2]
) -> None:
    """Rotate q (and k) in place by each token's position, pairs (i, i + rotary_dim/2) of each
    head's first rotary_dim dims; the rest are left as they are."""
    num_tokens, head_dim, half = positions.shape[0], q.shape[-1], cos_cache.shape[-1]
    assert positions.dim() == 1 and positions.dtype == torch.int64, "positions: [T] int64"
    _check_heads("q", q, num_tokens, head_dim)
    if k is not None:
        _check_heads("k", k, num_tokens, head_dim)
        assert k.dtype == q.dtype, f"k is {k.dtype}, q {q.dtype}"
    assert 0 < 2 * half <= head_dim, f"rotary dims {2 * half} of a {head_dim}-dim head"
    for name, table in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        assert table.dim() == 2 and table.shape[1] == half, f"{name} {table.shape}"
        assert table.stride(1) == 1, f"{name} rows must be contiguous"
    check_device(positions, q, cos_cache, sin_cache, *([] if k is None else [k]))
    if num_tokens == 0:
        return
    kk = q if k is None else k
    _rotary_kernel[(num_tokens,)](
        positions, q, kk, cos_cache, sin_cache,
        q.stride(0), q.stride(1), kk.stride(0), kk.stride(1),
        cos_cache.stride(0), sin_cache.stride(0),
        q.shape[1], kk.shape[1], half,
        HAS_K=k is not None,
        BLOCK_HQ=next_power_of_2(q.shape[1]), BLOCK_HK=next_power_of_2(kk.shape[1]),
        BLOCK_HALF=next_power_of_2(half),
    )  # fmt: skip
