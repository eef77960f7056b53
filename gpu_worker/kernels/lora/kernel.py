"""Batched LoRA shrink and expand (see the package docstring), and `lora_add`, the launcher
LoraLinearMethod's "triton" kernel calls."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_worker.kernels import check_device, next_power_of_2

MAX_SLICES = 3  # qkv_proj's q | k | v: the most slices of a LoRA layer (lora/layer.py)
TILE_ELEMENTS = 4096  # A or B elements a program holds at once: 32 per thread of 4 warps


@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # [T, K]
    a_ptr,  # [S, C, R, K]
    slots_ptr,  # [T] int32
    z_ptr,  # [T, C, R] float32
    K,
    R,
    stride_xm,
    NUM_SLICES: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot < 0:
        return
    r = tl.arange(0, BLOCK_R)
    kk = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + ((slot * NUM_SLICES + c) * R + r[:, None]) * K  # [BLOCK_R, 1]
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        x = tl.load(x_ptr + t * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
        a = tl.load(a_rows + k[None, :], mask=(r[:, None] < R) & (k[None, :] < K), other=0.0)
        acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
    tl.store(z_ptr + (t * NUM_SLICES + c) * R + r, acc, mask=r < R)


@triton.jit
def _lora_expand_kernel(
    z_ptr,  # [T, C, R] float32
    b_ptr,  # [S, N, R]
    slots_ptr,  # [T] int32
    y_ptr,  # [T, N], updated in place
    N,
    R,
    stride_ym,
    bound1,  # the slices' inner bounds (q | k | v: 2 of them; unused ones = N)
    bound2,
    NUM_SLICES: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot < 0:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, BLOCK_R)
    c = (n >= bound1).to(tl.int32) + (n >= bound2).to(tl.int32)  # each column's slice
    mask = (n[:, None] < N) & (r[None, :] < R)
    z = tl.load(z_ptr + (t * NUM_SLICES + c[:, None]) * R + r[None, :], mask=mask, other=0.0)
    b = tl.load(b_ptr + (slot * N + n[:, None]) * R + r[None, :], mask=mask, other=0.0)
    delta = tl.sum(b.to(tl.float32) * z, axis=1)
    y_at = y_ptr + t * stride_ym + n
    y = tl.load(y_at, mask=n < N, other=0.0).to(tl.float32)
    tl.store(y_at, (y + delta).to(y_ptr.dtype.element_ty), mask=n < N)


def lora_tiles(rank: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_K of the shrink, BLOCK_N of the expand) for adapters of `rank`: a
    TILE_ELEMENTS tile of A or B per program."""
    block_r = max(16, next_power_of_2(rank))
    block_k = max(32, min(256, TILE_ELEMENTS // block_r))
    block_n = max(16, min(256, TILE_ELEMENTS // block_r))
    return block_r, block_k, block_n


def lora_add(
    y: torch.Tensor,  # [T, out] float32 / bf16 / fp16, rows contiguous: updated in place
    x: torch.Tensor,  # [T, in], rows contiguous
    lora_a: torch.Tensor,  # [S, num_slices, R, in] contiguous
    lora_b: torch.Tensor,  # [S, out, R] contiguous
    slice_bounds: list[int],  # [num_slices + 1] output offsets, 0 .. out (host values)
    token_slots: torch.Tensor,  # [T] int32 contiguous, -1: none
) -> None:
    """y[t] += token t's LoRA delta (gpu_worker/lora/layer.py's formula), float32 sums, y
    rounded once. No host sync: a CUDA graph captures it for its batch size, reading
    token_slots (LoraMapping.buffer) when replayed."""
    num_loras, num_slices, rank, k = lora_a.shape
    t, n = y.shape
    assert x.dim() == 2 and x.shape == (t, k) and x.stride(1) == 1, f"x must be [{t}, {k}]"
    assert y.stride(1) == 1, "y's rows must be contiguous"
    assert lora_a.is_contiguous() and lora_b.is_contiguous(), "LoRA buffers must be contiguous"
    assert lora_b.shape == (num_loras, n, rank), f"lora_b {tuple(lora_b.shape)}"
    assert 1 <= num_slices <= MAX_SLICES, f"{num_slices} slices (at most {MAX_SLICES})"
    assert token_slots.dtype == torch.int32 and token_slots.shape == (t,), "bad token_slots"
    assert token_slots.is_contiguous(), "token_slots must be contiguous"
    check_device(y, x, lora_a, lora_b, token_slots)
    if t == 0:
        return
    assert len(slice_bounds) == num_slices + 1 and slice_bounds[0] == 0 and slice_bounds[-1] == n
    inner = slice_bounds[1:-1] + [n] * (MAX_SLICES - num_slices)
    block_r, block_k, block_n = lora_tiles(rank)
    z = torch.empty(t, num_slices, rank, dtype=torch.float32, device=y.device)
    _lora_shrink_kernel[(t, num_slices)](
        x, lora_a, token_slots, z, k, rank, x.stride(0),
        NUM_SLICES=num_slices, BLOCK_R=block_r, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    _lora_expand_kernel[(t, triton.cdiv(n, block_n))](
        z, lora_b, token_slots, y, n, rank, y.stride(0), inner[0], inner[1],
        NUM_SLICES=num_slices, BLOCK_R=block_r, BLOCK_N=block_n, num_warps=4,
    )  # fmt: skip
