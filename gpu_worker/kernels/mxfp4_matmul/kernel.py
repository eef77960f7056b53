"""x @ W^T (+ bias) with W in MXFP4 as gpt-oss checkpoints store it: blocks uint8 [N, K / 32,
16] (two E2M1 values a byte, the low nibble first) and scales uint8 [N, K / 32] (E8M0:
2 ** (scale - 127)). Each K step is one group of 32: the tile's nibbles are decoded to
floats (sign, 2-bit exponent, 1-bit mantissa), scaled by their group's exponent, cast to x's
dtype (exact: E2M1 values times a power of two) and multiplied by tl.dot into a float32 sum.
The weight is read packed: 17 bytes per 32 values."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_worker.kernels import check_device, dot_precision, matmul_out

GROUP = 32  # values per exponent: the kernel's K step


@triton.jit
def _mxfp4_matmul_kernel(
    x_ptr,
    blocks_ptr,
    scales_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    BLOCK_K: tl.constexpr = 32  # GROUP
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    i = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm + i[None, :]  # [BLOCK_M, BLOCK_K]
    x_mask = rm[:, None] < M
    w_mask = rn[None, :] < N
    groups = K // BLOCK_K
    # W^T tiles [BLOCK_K, BLOCK_N]: value i of group g of row n is nibble i % 2 of byte i // 2
    w_bytes = blocks_ptr + rn[None, :].to(tl.int64) * (groups * 16) + (i[:, None] // 2)
    w_shift = (i[:, None] % 2) * 4
    w_scales = scales_ptr + rn[None, :].to(tl.int64) * groups  # [1, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, groups):
        x = tl.load(x_rows + g * BLOCK_K, mask=x_mask, other=0.0)
        byte = tl.load(w_bytes + g * 16, mask=w_mask, other=0).to(tl.int32)
        nib = (byte >> w_shift) & 0xF
        exp = (nib >> 1) & 3
        man = (nib & 1).to(tl.float32)
        mag = tl.where(exp == 0, man * 0.5, (1.0 + man * 0.5) * tl.exp2((exp - 1).to(tl.float32)))
        val = tl.where(nib >= 8, -mag, mag)
        e8 = tl.load(w_scales + g, mask=w_mask, other=127).to(tl.int32)
        w = val * tl.exp2((e8 - 127).to(tl.float32))
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def mxfp4_tiles(m: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for m rows of x in dtype (gguf_matmul's: decode narrow
    N tiles, prefill 64 x 64, 32 x 64 in float32)."""
    if m <= 16:
        return 16, 32, 4
    return (32 if dtype == torch.float32 else 64), 64, 8


def mxfp4_matmul(
    x: torch.Tensor,  # [M, K] fp16 / bf16 / fp32
    blocks: torch.Tensor,  # [N, K / 32, 16] uint8
    scales: torch.Tensor,  # [N, K / 32] uint8
    bias: torch.Tensor | None = None,  # [N]
    out: torch.Tensor | None = None,  # [M, N] in x's dtype
) -> torch.Tensor:
    """x @ dequantize_mxfp4(blocks, scales)^T (+ bias), [M, N] in x's dtype, summed in float32."""
    n, groups = int(blocks.shape[0]), int(blocks.shape[1])
    k = groups * GROUP
    assert blocks.dtype == torch.uint8 and tuple(blocks.shape) == (n, groups, 16), (
        f"blocks must be uint8 [N, K/32, 16], got {blocks.dtype} {tuple(blocks.shape)}"
    )
    assert scales.dtype == torch.uint8 and tuple(scales.shape) == (n, groups), (
        f"scales must be uint8 [{n}, {groups}], got {scales.dtype} {tuple(scales.shape)}"
    )
    assert blocks.is_contiguous() and scales.is_contiguous(), "blocks and scales must be dense"
    out = matmul_out(x, k, n, out)
    tensors = [x, blocks, scales, out] + ([] if bias is None else [bias])
    check_device(*tensors)
    m = x.shape[0]
    if m == 0 or n == 0:
        return out
    if bias is not None:
        assert bias.shape == (n,) and bias.is_contiguous(), f"bias must be [{n}], dense"
    block_m, block_n, warps = mxfp4_tiles(m, x.dtype)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _mxfp4_matmul_kernel[grid](
        x, blocks, scales, out if bias is None else bias, out, m, n, k, x.stride(0),
        out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(x.dtype), num_warps=warps,
    )  # fmt: skip
    return out
