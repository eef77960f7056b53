"""Batched LoRA shrink and expand (see the package docstring), and `lora_add`, the launcher
LoraLinearMethod's "triton" kernel calls."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_worker.kernels import check_device, dot_precision, next_power_of_2

MAX_SLICES = 3  # qkv_proj's q | k | v: the most slices of a LoRA layer (lora/layer.py)
TILE_ELEMENTS = 4096  # A or B elements a program holds at once: 32 per thread of 4 warps
# more tokens than this take the segment kernels (prefill chunks); at most, the per-token ones
# (decode steps: no sort, nothing but the slots read, as a CUDA graph needs)
MAX_BGMV_TOKENS = 16


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


@triton.jit
def _sgmv_shrink_kernel(
    x_ptr,  # [T, K]
    a_ptr,  # [S, C, R, K]
    order_ptr,  # [T] int32: token indices sorted by slot (base tokens first)
    starts_ptr,  # [S + 1] int32: where slot s's tokens start in order, + 1 (0: base)
    counts_ptr,  # [S + 1] int32: tokens of slot s, at s + 1
    z_ptr,  # [T, C, R] float32
    K,
    R,
    stride_xm,
    NUM_SLICES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program per (BLOCK_M tokens of one slot, slice, slot): a tl.dot of the tokens'
    rows of x by the slot's A^T (Punica's sgmv, on tokens gathered by slot)."""
    pid_m = tl.program_id(0)
    c = tl.program_id(1)
    slot = tl.program_id(2)
    count = tl.load(counts_ptr + slot + 1)
    if pid_m * BLOCK_M >= count:
        return
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    tokens = tl.load(order_ptr + tl.load(starts_ptr + slot + 1) + m, mask=m < count, other=0)
    tokens = tokens.to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    kk = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + ((slot.to(tl.int64) * NUM_SLICES + c) * R + r[None, :]) * K  # [1, BLOCK_R]
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        x = tl.load(x_ptr + tokens[:, None] * stride_xm + k[None, :],
                    mask=(m[:, None] < count) & (k[None, :] < K), other=0.0)  # fmt: skip
        a = tl.load(a_rows + k[:, None], mask=(k[:, None] < K) & (r[None, :] < R), other=0.0)
        acc = tl.dot(x.to(tl.float32), a.to(tl.float32), acc, input_precision=DOT_PRECISION)
    z = z_ptr + (tokens[:, None] * NUM_SLICES + c) * R + r[None, :]
    tl.store(z, acc, mask=(m[:, None] < count) & (r[None, :] < R))


@triton.jit
def _sgmv_expand_kernel(
    z_ptr,  # [T, C, R] float32
    b_ptr,  # [S, N, R]
    order_ptr,
    starts_ptr,
    counts_ptr,
    y_ptr,  # [T, N], updated in place
    N,
    R,
    stride_ym,
    bound1,
    bound2,
    NUM_SLICES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program per (BLOCK_M tokens of one slot, BLOCK_N columns of one slice, slot and
    slice): y[tokens, cols] += z[tokens, slice] @ B[slot, cols]^T."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.program_id(2) // NUM_SLICES
    c = tl.program_id(2) % NUM_SLICES
    count = tl.load(counts_ptr + slot + 1)
    lo = tl.where(c == 0, 0, tl.where(c == 1, bound1, bound2))
    hi = tl.where(c == NUM_SLICES - 1, N, tl.where(c == 0, bound1, bound2))
    n = lo + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if (pid_m * BLOCK_M >= count) | (lo + pid_n * BLOCK_N >= hi):
        return
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    tokens = tl.load(order_ptr + tl.load(starts_ptr + slot + 1) + m, mask=m < count, other=0)
    tokens = tokens.to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    z = tl.load(z_ptr + (tokens[:, None] * NUM_SLICES + c) * R + r[None, :],
                mask=(m[:, None] < count) & (r[None, :] < R), other=0.0)  # fmt: skip
    b = tl.load(b_ptr + (slot.to(tl.int64) * N + n[None, :]) * R + r[:, None],
                mask=(r[:, None] < R) & (n[None, :] < hi), other=0.0)  # fmt: skip
    delta = tl.dot(z, b.to(tl.float32), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
    mask = (m[:, None] < count) & (n[None, :] < hi)
    y_at = y_ptr + tokens[:, None] * stride_ym + n[None, :]
    y = tl.load(y_at, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_at, (y + delta).to(y_ptr.dtype.element_ty), mask=mask)


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
    if t > MAX_BGMV_TOKENS:
        _sgmv(y, x, lora_a, lora_b, slice_bounds, token_slots, z, inner)
        return
    _lora_shrink_kernel[(t, num_slices)](
        x, lora_a, token_slots, z, k, rank, x.stride(0),
        NUM_SLICES=num_slices, BLOCK_R=block_r, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    _lora_expand_kernel[(t, triton.cdiv(n, block_n))](
        z, lora_b, token_slots, y, n, rank, y.stride(0), inner[0], inner[1],
        NUM_SLICES=num_slices, BLOCK_R=block_r, BLOCK_N=block_n, num_warps=4,
    )  # fmt: skip


def sgmv_tiles(dtype: torch.dtype, rank: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_K, BLOCK_N) of the segment kernels. float32's IEEE dots run on FMA
    units, not tensor cores: smaller tiles keep them in registers (32 x 64 tiles took ~200
    registers at rank 16 and spilled 4 KB at rank 64; tests/kernels/cuda_compile.py)."""
    if dtype == torch.float32:
        return (16, 32, 32) if rank <= 16 else (16, 16, 16)
    return 32, 64, 64


def slot_groups(token_slots: torch.Tensor, num_loras: int) -> tuple[torch.Tensor, ...]:
    """(order, starts, counts) int32: the tokens sorted by slot (base tokens first, stable),
    and at s + 1 where slot s's tokens start in order and how many there are (at 0: base).
    Torch ops on the device, no host sync."""
    order = torch.argsort(token_slots, stable=True).to(torch.int32)
    counts = torch.bincount(token_slots.long() + 1, minlength=num_loras + 1).to(torch.int32)
    starts = (torch.cumsum(counts, 0, dtype=torch.int32) - counts).to(torch.int32)
    return order, starts, counts


def _sgmv(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
          slice_bounds: list[int], token_slots: torch.Tensor, z: torch.Tensor,
          inner: list[int]) -> None:  # fmt: skip
    """The segment kernels: tokens gathered by slot, tl.dot tiles (sgmv_tiles)."""
    num_loras, num_slices, rank, k = lora_a.shape
    t, n = y.shape
    order, starts, counts = slot_groups(token_slots, num_loras)
    block_r = lora_tiles(rank)[0]
    precision = dot_precision(y.dtype)
    block_m, block_k, block_n = sgmv_tiles(y.dtype, rank)
    m_blocks = triton.cdiv(t, block_m)
    _sgmv_shrink_kernel[(m_blocks, num_slices, num_loras)](
        x, lora_a, order, starts, counts, z, k, rank, x.stride(0),
        NUM_SLICES=num_slices, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k,
        DOT_PRECISION=precision, num_warps=4,
    )  # fmt: skip
    widest = max(hi - lo for lo, hi in zip(slice_bounds, slice_bounds[1:], strict=False))
    grid = (m_blocks, triton.cdiv(widest, block_n), num_loras * num_slices)
    _sgmv_expand_kernel[grid](
        z, lora_b, order, starts, counts, y, n, rank, y.stride(0), inner[0], inner[1],
        NUM_SLICES=num_slices, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_N=block_n,
        DOT_PRECISION=precision, num_warps=4,
    )  # fmt: skip
