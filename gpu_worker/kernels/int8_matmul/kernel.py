"""W8A8: per-row dynamic int8 quantization of x, then an int8 GEMM with int32 accumulation."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_worker.kernels import check_device, matmul_out, next_power_of_2, split_k_ranges

MAX_QUANT_BLOCK = 4096  # columns a quantize program holds at once; longer rows loop


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    cols,
    stride_x,
    stride_q,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(0, cols, BLOCK):
        x = tl.load(x_ptr + row * stride_x + c0 + offs, mask=c0 + offs < cols, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = tl.max(amax, 0) / 127.0
    tl.store(scale_ptr + row, scale)
    for c0 in range(0, cols, BLOCK):
        mask = c0 + offs < cols
        x = tl.load(x_ptr + row * stride_x + c0 + offs, mask=mask, other=0.0).to(tl.float32)
        v = x / tl.where(scale > 0, scale, 1.0)  # an all-zero row stays zero
        q = tl.minimum(tl.floor(tl.abs(v) + 0.5), 127.0)  # round half away from zero
        q = tl.where(v < 0, -q, q)
        tl.store(q_ptr + row * stride_q + c0 + offs, q.to(tl.int8), mask=mask)


@triton.jit
def _int8_matmul_kernel(
    xq_ptr,
    x_scale_ptr,
    w_ptr,
    w_scale_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    stride_os,
    k_per_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,  # store raw int32 sums of this program's K range, scaled after
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_rows = xq_ptr + rm[:, None].to(tl.int64) * stride_xm  # [BLOCK_M, 1]
    w_cols = w_ptr + rn[None, :].to(tl.int64) * stride_wn  # [1, BLOCK_N]: W^T tiles
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + rk
        x = tl.load(x_rows + k[None, :], mask=(rm[:, None] < M) & (k[None, :] < k_end), other=0)
        w = tl.load(w_cols + k[:, None], mask=(k[:, None] < k_end) & (rn[None, :] < N), other=0)
        acc = tl.dot(x, w, acc, out_dtype=tl.int32)
    out_mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT:
        part = out_ptr + pid_k * stride_os + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
        tl.store(part, acc, mask=out_mask)
    else:
        x_scale = tl.load(x_scale_ptr + rm, mask=rm < M, other=0.0)
        w_scale = tl.load(w_scale_ptr + rn, mask=rn < N, other=0.0)
        result = acc.to(tl.float32) * x_scale[:, None] * w_scale[None, :]
        out = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
        tl.store(out, result.to(out_ptr.dtype.element_ty), mask=out_mask)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] float -> (int8 [R, C], float32 scale [R]), as `quantize_rows_reference`."""
    assert x.dim() == 2 and x.stride(1) == 1, "x must be [rows, cols] with contiguous rows"
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32), f"x is {x.dtype}"
    check_device(x)
    q = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    scale = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return q, scale
    block = min(MAX_QUANT_BLOCK, next_power_of_2(x.shape[1]))
    _quantize_rows_kernel[(x.shape[0],)](
        x, q, scale, x.shape[1], x.stride(0), q.stride(0),
        BLOCK=block, num_warps=min(8, max(1, block // 256)),
    )  # fmt: skip
    return q, scale


def int8_tiles(m: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for m rows. Decode (m <= 16): ~55-85
    registers; prefill: ~70 (sm_90) / ~190 (sm_80) registers, 72 KB of shared memory on
    sm_90, no spills (tests/kernels/cuda_compile.py, 16-byte aligned rows)."""
    if m <= 16:
        return 16, 64, 128, 4, 3
    return 64, 128, 128, 8, 3


def int8_matmul(
    x: torch.Tensor,  # [M, K] fp16 / bf16 / fp32
    weight: torch.Tensor,  # [N, K] int8
    weight_scale: torch.Tensor,  # [N] float32, per output channel
    out: torch.Tensor | None = None,  # [M, N] in x's dtype
    split_k: int | None = None,  # K ranges of exact int32 sums; None: decode_split_k
) -> torch.Tensor:
    """x @ (weight * weight_scale[:, None])^T with x quantized per row to int8; x's dtype.

    Decode-sized x (M <= 16) on a GPU may split K over more programs (`decode_split_k`):
    the int32 sums are exact, so the result is bit-identical whatever the split."""
    m, k = x.shape
    n = weight.shape[0]
    out = matmul_out(x, k, n, out)
    assert weight.dtype == torch.int8 and weight.shape == (n, k) and weight.stride(1) == 1, (
        f"weight must be int8 [N, {k}] with contiguous rows, got {weight.dtype} "
        f"{tuple(weight.shape)}"
    )
    assert weight_scale.dtype == torch.float32 and weight_scale.shape == (n,), (
        f"weight_scale must be float32 [{n}], got {weight_scale.dtype} {tuple(weight_scale.shape)}"
    )
    assert weight_scale.is_contiguous(), "weight_scale must be contiguous"
    check_device(x, weight, weight_scale, out)
    if m == 0 or n == 0 or k == 0:
        return out.zero_()  # an empty sum
    xq, x_scale = quantize_rows(x)
    block_m, block_n, block_k, warps, stages = int8_tiles(m)
    tiles = triton.cdiv(n, block_n)
    split_k, per_split = split_k_ranges(split_k, m, tiles, k, block_k, x.device)
    target = out if split_k == 1 else torch.empty(split_k, m, n, dtype=torch.int32,
                                                  device=x.device)  # fmt: skip
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), split_k)
    _int8_matmul_kernel[grid](
        xq, x_scale, weight, weight_scale, target, m, n, k,
        xq.stride(0), weight.stride(0), target.stride(-2),
        0 if split_k == 1 else target.stride(0), per_split,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split_k > 1,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if split_k > 1:  # exact integer sums, then the kernel's own scaling order
        out.copy_(target.sum(0).float() * x_scale[:, None] * weight_scale[None, :])
    return out
