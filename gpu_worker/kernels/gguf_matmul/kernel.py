"""x @ W^T with W in a GGUF block format, dequantized in registers inside a tiled GEMM."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_worker.kernels import check_device, dot_precision, matmul_out, split_k_ranges
from gpu_worker.kernels.gguf_matmul.reference import GGUF_BLOCKS, QTYPE_NAMES, row_bytes

# the ggml type ids of reference.py, as constexprs the kernel's branches compare against
_Q4_0, _Q4_1, _Q5_0, _Q5_1 = tl.constexpr(2), tl.constexpr(3), tl.constexpr(6), tl.constexpr(7)
_Q8_0, _Q4_K, _Q5_K, _Q6_K = tl.constexpr(8), tl.constexpr(12), tl.constexpr(13), tl.constexpr(14)


@triton.jit
def _byte(ptr, mask):
    """The uint8 at each pointer, zero-extended to int32."""
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _f16(ptr, mask):
    """The little-endian fp16 at each (even) byte address, as float32."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _legacy(blk, i, mask, QTYPE: tl.constexpr):
    """Q4_0 / Q4_1 / Q5_0 / Q5_1: the [32, BLOCK_N] tile of the blocks at `blk`
    ([1, BLOCK_N] pointers, one block per column); i = arange(32)[:, None]."""
    d = _f16(blk, mask)  # [1, BLOCK_N]
    HAS_MIN: tl.constexpr = QTYPE == _Q4_1 or QTYPE == _Q5_1
    HAS_HIGH: tl.constexpr = QTYPE == _Q5_0 or QTYPE == _Q5_1
    QH_AT: tl.constexpr = 4 if HAS_MIN else 2
    QS_AT: tl.constexpr = QH_AT + 4 if HAS_HIGH else QH_AT
    q = (_byte(blk + QS_AT + (i % 16), mask) >> ((i // 16) * 4)) & 0xF
    if HAS_HIGH:  # bit i of a little-endian uint32
        q |= ((_byte(blk + QH_AT + i // 8, mask) >> (i % 8)) & 1) << 4
    if HAS_MIN:
        w = d * q.to(tl.float32) + _f16(blk + 2, mask)
    else:
        OFFSET: tl.constexpr = 16 if HAS_HIGH else 8
        w = d * (q - OFFSET).to(tl.float32)
    return w


@triton.jit
def _q8_0(blk, i, mask):
    """Q8_0: the [32, BLOCK_N] tile of the blocks at `blk`; i = arange(32)[:, None]."""
    q = tl.load(blk + 2 + i, mask=mask, other=0).to(tl.int8, bitcast=True)
    return _f16(blk, mask) * q.to(tl.float32)


@triton.jit
def _q6_k(blk, j0, i, mask):
    """Q6_K: elements j0 + i (i = arange(32)[:, None], j0 a multiple of 32) of the
    super-blocks at `blk` ([1, BLOCK_N] pointers): a [32, BLOCK_N] tile."""
    q = (_byte(blk + (j0 // 128) * 64 + j0 % 64 + i, mask) >> (((j0 // 64) & 1) * 4)) & 0xF
    high = _byte(blk + 128 + (j0 // 128) * 32 + i, mask)
    q |= ((high >> (((j0 // 32) & 3) * 2)) & 3) << 4
    # one int8 scale per 16 elements: two per tile
    sc0 = tl.load(blk + 192 + j0 // 16, mask=mask, other=0).to(tl.int8, bitcast=True)
    sc1 = tl.load(blk + 193 + j0 // 16, mask=mask, other=0).to(tl.int8, bitcast=True)
    sc = tl.where(i < 16, sc0.to(tl.float32), sc1.to(tl.float32))
    return _f16(blk + 208, mask) * sc * (q - 32).to(tl.float32)


@triton.jit
def _q45_k(blk, j0, i, mask, QTYPE: tl.constexpr):
    """Q4_K / Q5_K: elements j0 + i as `_q6_k`."""
    # sub-block s = j0 / 32: 6-bit scale and min, s < 4 in bytes 4..11, s >= 4 split in three
    s = j0 // 32
    a = _byte(blk + 4 + (s & 3), mask)
    b = _byte(blk + 8 + (s & 3), mask)
    if s >= 4:
        c = _byte(blk + 12 + (s & 3), mask)
        sc = (c & 0x0F) | ((a >> 2) & 0x30)
        mn = (c >> 4) | ((b >> 2) & 0x30)
    else:
        sc = a & 0x3F
        mn = b & 0x3F
    QS_AT: tl.constexpr = 16 if QTYPE == _Q4_K else 48
    q = (_byte(blk + QS_AT + (j0 // 64) * 32 + i, mask) >> ((s & 1) * 4)) & 0xF
    if QTYPE == _Q5_K:
        q |= ((_byte(blk + 16 + i, mask) >> s) & 1) << 4
    d = _f16(blk, mask) * sc.to(tl.float32)
    return d * q.to(tl.float32) - _f16(blk + 2, mask) * mn.to(tl.float32)


@triton.jit
def _gguf_matmul_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    stride_os,
    k_per_split,
    QTYPE: tl.constexpr,
    QK: tl.constexpr,
    TYPE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # one K step is 32 elements: a legacy block or a K-quant sub-block, so every scale of a
    # tile is one value per column, and K (a multiple of 32) needs no mask
    BLOCK_K: tl.constexpr = 32  # GGUF_BLOCK_K
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)  # split-K: this program's K range; partials summed after
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    i = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm + i[None, :]  # [BLOCK_M, BLOCK_K]
    x_mask = rm[:, None] < M
    w_cols = w_ptr + rn[None, :].to(tl.int64) * stride_wn  # [1, BLOCK_N]: W^T tiles
    w_mask = rn[None, :] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        x = tl.load(x_rows + k0, mask=x_mask, other=0.0)
        blk = w_cols + (k0 // QK) * TYPE_SIZE
        if QTYPE == _Q8_0:
            w = _q8_0(blk, i[:, None], w_mask)
        elif QTYPE == _Q6_K:
            w = _q6_k(blk, k0 % QK, i[:, None], w_mask)
        elif QK == 256:
            w = _q45_k(blk, k0 % QK, i[:, None], w_mask, QTYPE)
        else:
            w = _legacy(blk, i[:, None], w_mask, QTYPE)
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision=DOT_PRECISION)
    out = out_ptr + pid_k * stride_os + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


GGUF_BLOCK_K = 32  # the kernel's K step: one legacy block or one K-quant sub-block


def gguf_tiles(m: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for m rows of x in dtype; BLOCK_K is 32.

    Decode (m <= 16): narrow N tiles, for more programs on a weight-bound GEMM. Prefill:
    64 x 64 over 8 warps; 32 x 64 in float32, whose IEEE dot runs on FMAs and would spill
    in 64 x 64. Registers per thread (sm_90 / sm_80, no spills) are in
    tests/kernels/cuda_compile.py's output."""
    if m <= 16:
        return 16, 32, 4
    return (32 if dtype == torch.float32 else 64), 64, 8


def gguf_matmul(
    x: torch.Tensor,  # [M, K] fp16 / bf16 / fp32
    weight: torch.Tensor,  # [N, row_bytes] uint8, the GGUF tensor's raw blocks
    qtype: int,  # ggml type id (gguf.GGMLQuantizationType)
    n: int,
    k: int,
    out: torch.Tensor | None = None,  # [M, N] in x's dtype
    split_k: int | None = None,  # K ranges summed in float32 after; None: decode_split_k
) -> torch.Tensor:
    """x @ dequantize(weight)^T, [M, N] in x's dtype, accumulated in float32.

    Decode-sized x (M <= 16) on a GPU may split K over more programs (`decode_split_k`);
    the split depends on N and K only, never on M, so every row of a decode batch gets the
    same summation order whatever the batch."""
    assert qtype in GGUF_BLOCKS, f"unsupported ggml type {qtype}: {sorted(QTYPE_NAMES.values())}"
    qk, type_size = GGUF_BLOCKS[qtype]
    out = matmul_out(x, k, n, out)
    assert weight.dtype == torch.uint8, f"weight must be uint8 blocks, got {weight.dtype}"
    assert weight.shape == (n, row_bytes(qtype, k)) and weight.stride(1) == 1, (
        f"weight {tuple(weight.shape)} is not [{n}, {row_bytes(qtype, k)}] dense rows "
        f"for {QTYPE_NAMES[qtype]} K={k}"
    )
    m = x.shape[0]
    check_device(x, weight, out)
    if m == 0 or n == 0 or k == 0:
        return out.zero_()  # an empty sum
    block_m, block_n, warps = gguf_tiles(m, x.dtype)
    tiles = triton.cdiv(n, block_n)
    split_k, per_split = split_k_ranges(split_k, m, tiles, k, GGUF_BLOCK_K, x.device)
    target = out if split_k == 1 else torch.empty(split_k, m, n, device=x.device)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), split_k)
    _gguf_matmul_kernel[grid](
        x, weight, target, m, n, k, x.stride(0), weight.stride(0), target.stride(-2),
        0 if split_k == 1 else target.stride(0), per_split,
        QTYPE=qtype, QK=qk, TYPE_SIZE=type_size,
        BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(x.dtype), num_warps=warps,
    )  # fmt: skip
    if split_k > 1:
        out.copy_(target.sum(0))
    return out
