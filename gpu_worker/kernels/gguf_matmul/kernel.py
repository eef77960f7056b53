"""x @ W^T with W in a GGUF block format, dequantized in registers inside a tiled GEMM."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_worker.kernels import check_device, dot_precision
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
def _legacy(base, j, mask, QTYPE: tl.constexpr):
    """Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1: element j (< 32) of the block at `base`."""
    d = _f16(base, mask)
    if QTYPE == _Q8_0:
        q = tl.load(base + 2 + j, mask=mask, other=0).to(tl.int8, bitcast=True)
        return d * q.to(tl.float32)
    HAS_MIN: tl.constexpr = QTYPE == _Q4_1 or QTYPE == _Q5_1
    HAS_HIGH: tl.constexpr = QTYPE == _Q5_0 or QTYPE == _Q5_1
    QH_AT: tl.constexpr = 4 if HAS_MIN else 2
    QS_AT: tl.constexpr = QH_AT + 4 if HAS_HIGH else QH_AT
    q = (_byte(base + QS_AT + (j % 16), mask) >> ((j // 16) * 4)) & 0xF
    if HAS_HIGH:  # bit j of a little-endian uint32
        q |= ((_byte(base + QH_AT + j // 8, mask) >> (j % 8)) & 1) << 4
    if HAS_MIN:
        return d * q.to(tl.float32) + _f16(base + 2, mask)
    OFFSET: tl.constexpr = 16 if HAS_HIGH else 8
    return d * (q - OFFSET).to(tl.float32)


@triton.jit
def _k_quant(base, j, mask, QTYPE: tl.constexpr):
    """Q4_K / Q5_K / Q6_K: element j (< 256) of the super-block at `base`."""
    if QTYPE == _Q6_K:
        q = (_byte(base + (j // 128) * 64 + j % 64, mask) >> (((j // 64) & 1) * 4)) & 0xF
        high = _byte(base + 128 + (j // 128) * 32 + j % 32, mask)
        q |= ((high >> (((j // 32) & 3) * 2)) & 3) << 4
        sc = tl.load(base + 192 + j // 16, mask=mask, other=0).to(tl.int8, bitcast=True)
        return _f16(base + 208, mask) * sc.to(tl.float32) * (q - 32).to(tl.float32)
    # sub-block s = j / 32: 6-bit scale and min, s < 4 in bytes 4..11, s >= 4 split in three
    s = j // 32
    is_hi = s >= 4
    a = _byte(base + 4 + (s & 3), mask)
    b = _byte(base + 8 + (s & 3), mask)
    c = _byte(base + 12 + (s & 3), mask)
    sc = tl.where(is_hi, (c & 0x0F) | ((a >> 2) & 0x30), a & 0x3F)
    mn = tl.where(is_hi, (c >> 4) | ((b >> 2) & 0x30), b & 0x3F)
    QS_AT: tl.constexpr = 16 if QTYPE == _Q4_K else 48
    q = (_byte(base + QS_AT + (j // 64) * 32 + j % 32, mask) >> ((s & 1) * 4)) & 0xF
    if QTYPE == _Q5_K:
        q |= ((_byte(base + 16 + j % 32, mask) >> s) & 1) << 4
    d = _f16(base, mask) * sc.to(tl.float32)
    return d * q.to(tl.float32) - _f16(base + 2, mask) * mn.to(tl.float32)


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
    QTYPE: tl.constexpr,
    QK: tl.constexpr,
    TYPE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm  # [BLOCK_M, 1]
    w_rows = w_ptr + rn[None, :].to(tl.int64) * stride_wn  # [1, BLOCK_N]: W^T tiles
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        x = tl.load(x_rows + k[None, :], mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)
        kk = k[:, None]  # [BLOCK_K, 1]
        base = w_rows + (kk // QK) * TYPE_SIZE  # [BLOCK_K, BLOCK_N]: each element's block
        mask = (kk < K) & (rn[None, :] < N)
        if QK == 32:
            w = _legacy(base, kk % QK, mask, QTYPE)
        else:
            w = _k_quant(base, kk % QK, mask, QTYPE)
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision=DOT_PRECISION)
    out = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def gguf_tiles(m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for m rows: decode (m <= 16) to prefill."""
    if m <= 16:
        return 16, 64, 64, 4
    if m < 64:
        return 32, 64, 64, 4
    return 64, 64, 64, 4


def gguf_matmul(
    x: torch.Tensor,  # [M, K] fp16 / bf16 / fp32
    weight: torch.Tensor,  # [N, row_bytes] uint8, the GGUF tensor's raw blocks
    qtype: int,  # ggml type id (gguf.GGMLQuantizationType)
    n: int,
    k: int,
    out: torch.Tensor | None = None,  # [M, N] in x's dtype
) -> torch.Tensor:
    """x @ dequantize(weight)^T, [M, N] in x's dtype, accumulated in float32."""
    assert qtype in GGUF_BLOCKS, f"unsupported ggml type {qtype}: {sorted(QTYPE_NAMES.values())}"
    qk, type_size = GGUF_BLOCKS[qtype]
    assert x.dim() == 2 and x.shape[1] == k and x.stride(1) == 1, "x must be [M, K], rows dense"
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32), f"x is {x.dtype}"
    assert weight.dtype == torch.uint8, f"weight must be uint8 blocks, got {weight.dtype}"
    assert weight.shape == (n, row_bytes(qtype, k)) and weight.stride(1) == 1, (
        f"weight {tuple(weight.shape)} is not [{n}, {row_bytes(qtype, k)}] dense rows "
        f"for {QTYPE_NAMES[qtype]} K={k}"
    )
    m = x.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    assert out.shape == (m, n) and out.dtype == x.dtype and out.stride(1) == 1, "bad out"
    check_device(x, weight, out)
    if m == 0 or n == 0:
        return out
    block_m, block_n, block_k, warps = gguf_tiles(m)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _gguf_matmul_kernel[grid](
        x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        QTYPE=qtype, QK=qk, TYPE_SIZE=type_size,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION=dot_precision(x.dtype), num_warps=warps,
    )  # fmt: skip
    return out
