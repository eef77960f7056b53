"""Fused MoE on float experts: sorted, padded pairs; gate/up with the activation, then down
with the routing weights (see the package docstring)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_worker.kernels import check_device, dot_precision

BLOCK_M = 16  # pairs per block (one expert each): fixed, so a row's tiles never change


@triton.jit
def _moe_gate_up_kernel(
    x_ptr,
    w13_ptr,
    h_ptr,
    pair_ids_ptr,
    block_experts_ptr,
    num_pairs,
    top_k,
    hidden,
    width,
    stride_x,
    stride_we,
    stride_wn,
    stride_h,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    rows = tl.load(pair_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows < num_pairs
    tokens = (rows // top_k).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    w = w13_ptr + expert * stride_we
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + rk
        xs = tl.load(x_ptr + tokens[:, None] * stride_x + k[None, :],
                     mask=valid[:, None] & (k[None, :] < hidden), other=0.0)  # fmt: skip
        wmask = (k[:, None] < hidden) & (rn[None, :] < width)
        wg = tl.load(w + rn[None, :].to(tl.int64) * stride_wn + k[:, None], mask=wmask, other=0.0)
        wu = tl.load(w + (rn[None, :] + width).to(tl.int64) * stride_wn + k[:, None],
                     mask=wmask, other=0.0)  # fmt: skip
        xs = xs.to(tl.float32)  # (bf16 tiles widened: tf32 holds them exactly)
        gate = tl.dot(xs, wg.to(tl.float32), gate, input_precision=PRECISION)
        up = tl.dot(xs, wu.to(tl.float32), up, input_precision=PRECISION)
    h = gate / (1.0 + tl.exp(-gate)) * up
    out = h_ptr + rows[:, None].to(tl.int64) * stride_h + rn[None, :]
    tl.store(out, h.to(h_ptr.dtype.element_ty), mask=valid[:, None] & (rn[None, :] < width))


@triton.jit
def _moe_down_kernel(
    h_ptr,
    w2_ptr,
    out_ptr,
    weights_ptr,
    pair_ids_ptr,
    block_experts_ptr,
    num_pairs,
    hidden,
    width,
    stride_h,
    stride_we,
    stride_wn,
    stride_o,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    rows = tl.load(pair_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows < num_pairs
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    w = w2_ptr + expert * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, width, BLOCK_K):
        k = k0 + rk
        a = tl.load(h_ptr + rows[:, None].to(tl.int64) * stride_h + k[None, :],
                    mask=valid[:, None] & (k[None, :] < width), other=0.0)  # fmt: skip
        wd = tl.load(w + rn[None, :].to(tl.int64) * stride_wn + k[:, None],
                     mask=(k[:, None] < width) & (rn[None, :] < hidden), other=0.0)  # fmt: skip
        acc = tl.dot(a.to(tl.float32), wd.to(tl.float32), acc, input_precision=PRECISION)
    weight = tl.load(weights_ptr + rows, mask=valid, other=0.0).to(tl.float32)
    acc = acc * weight[:, None]
    out = out_ptr + rows[:, None].to(tl.int64) * stride_o + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (rn[None, :] < hidden))


def align_by_expert(
    ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair ids [blocks * block_m] int32, the expert of each block [blocks] int32): the
    flattened pairs of ids [T, k] by expert, ties in token order (a stable sort), each
    expert's run padded to a multiple of block_m with T * k (no pair)."""
    flat = ids.reshape(-1)
    num_pairs = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    order = torch.sort(flat, stable=True).indices
    padded = (counts + block_m - 1) // block_m * block_m
    blocks = padded // block_m
    starts = torch.cumsum(padded, 0) - padded
    firsts = torch.cumsum(counts, 0) - counts
    pair_ids = torch.full((int(padded.sum()),), num_pairs, dtype=torch.int32, device=ids.device)
    rank = torch.arange(num_pairs, device=ids.device) - firsts[flat[order]]
    pair_ids[starts[flat[order]] + rank] = order.to(torch.int32)
    block_experts = torch.repeat_interleave(
        torch.arange(num_experts, device=ids.device, dtype=torch.int32), blocks
    )
    return pair_ids, block_experts


def moe_tiles(width: int, hidden: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps)."""
    return 64, 32, 4


def fused_moe(
    x: torch.Tensor,  # [T, H] fp16 / bf16 / fp32
    w13: torch.Tensor,  # [E, 2 * I, H], x's dtype
    w2: torch.Tensor,  # [E, H, I]
    weights: torch.Tensor,  # [T, k]
    ids: torch.Tensor,  # [T, k] int64
) -> torch.Tensor:  # [T, k, H] float32: each pair's weighted expert output
    """Each (token, slot) pair's routing weight times its expert's output, [T, k, H] in
    float32 (the caller adds a token's k in expert id order)."""
    num_tokens, top_k = ids.shape
    num_experts, two_width, hidden = w13.shape
    width = two_width // 2
    assert x.shape == (num_tokens, hidden) and x.stride(1) == 1, f"x {tuple(x.shape)}"
    assert w2.shape == (num_experts, hidden, width), f"w2 {tuple(w2.shape)}"
    assert w13.is_contiguous() and w2.is_contiguous(), "expert weights must be contiguous"
    assert w13.dtype == w2.dtype == x.dtype, f"x {x.dtype}, w13 {w13.dtype}, w2 {w2.dtype}"
    check_device(x, w13, w2, weights, ids)
    num_pairs = num_tokens * top_k
    out = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    if num_pairs == 0:
        return out.view(num_tokens, top_k, hidden)
    pair_ids, block_experts = align_by_expert(ids, num_experts)
    h = torch.empty(num_pairs, width, dtype=x.dtype, device=x.device)
    wts = weights.reshape(-1).to(torch.float32).contiguous()
    block_n, block_k, warps = moe_tiles(width, hidden)
    precision = dot_precision(x.dtype)
    blocks = block_experts.numel()
    _moe_gate_up_kernel[(blocks, triton.cdiv(width, block_n))](
        x, w13, h, pair_ids, block_experts, num_pairs, top_k, hidden, width,
        x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision,
        num_warps=warps,
    )  # fmt: skip
    _moe_down_kernel[(blocks, triton.cdiv(hidden, block_n))](
        h, w2, out, wts, pair_ids, block_experts, num_pairs, hidden, width,
        h.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision,
        num_warps=warps,
    )  # fmt: skip
    return out.view(num_tokens, top_k, hidden)
