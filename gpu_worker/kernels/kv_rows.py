"""Quantized KV rows in Triton (gpu_worker/kv_quant.py says how a row is stored): reading a
tile of rows as floats, and quantizing a token's rows as the store kernel writes them.

KV_KIND is kv_quant's code: 0/1 the model's float dtype (the cache's own elements), 2 int8
(head_dim values, then the row's float32 scale in 4 bytes), 3 fp8 e4m3fn, 4 fp8 e5m2 (scale
1). fp8 is decoded and encoded with integer and float32 operations only (no fp8 type), so
the same code runs on sm_80, sm_90 and under the interpreter, and the encoding rounds to
nearest even exactly as torch's float32 -> float8 conversion does.
"""

from __future__ import annotations

import triton
import triton.language as tl

# 1.5 * 2**23: (y + M) - M rounds |y| < 2**22 to nearest even
ROUND_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def _f32_from_bits(bits):
    return bits.to(tl.uint32).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_decode(bits, EXP_BITS: tl.constexpr, MAN_BITS: tl.constexpr, TINY: tl.constexpr):
    """uint8/int32 fp8 bits -> float32 (finite values; the store clamps, never writes NaN).
    TINY: the smallest subnormal, 2^(2 - 2^(EXP_BITS - 1) - MAN_BITS)."""
    b = bits.to(tl.int32) & 255
    bias: tl.constexpr = (1 << (EXP_BITS - 1)) - 1
    e = (b >> MAN_BITS) & ((1 << EXP_BITS) - 1)
    m = b & ((1 << MAN_BITS) - 1)
    normal = _f32_from_bits(((e + (127 - bias)) << 23) | (m << (23 - MAN_BITS)))
    value = tl.where(e == 0, m.to(tl.float32) * TINY, normal)  # subnormal: m * TINY
    return tl.where((b & 128) != 0, -value, value)


@triton.jit
def load_kv_rows(
    ptr,  # the cache (K or V part)
    offs,  # [N] int64: each row's first element (elements of the cache's dtype)
    d,  # [D] arange
    mask,  # [N, D]
    row_mask,  # [N]
    head_dim,
    KV_KIND: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
):
    """[N, D] rows read as OUT_DTYPE (masked entries 0)."""
    if KV_KIND <= 1:
        x = tl.load(ptr + offs[:, None] + d[None, :], mask=mask, other=0.0).to(OUT_DTYPE)
    elif KV_KIND == 2:
        q = tl.load(ptr + offs[:, None] + d[None, :], mask=mask, other=0).to(tl.float32)
        scale_at = ptr + offs + head_dim
        bits = tl.load(scale_at, mask=row_mask, other=0).to(tl.uint8, bitcast=True).to(tl.uint32)
        for i in tl.static_range(1, 4):
            byte = tl.load(scale_at + i, mask=row_mask, other=0).to(tl.uint8, bitcast=True)
            bits = bits | (byte.to(tl.uint32) << (8 * i))
        scale = bits.to(tl.float32, bitcast=True)
        x = (q * scale[:, None]).to(OUT_DTYPE)
    elif KV_KIND == 3:
        b = tl.load(ptr + offs[:, None] + d[None, :], mask=mask, other=0)
        x = _fp8_decode(b, 4, 3, 0.001953125).to(OUT_DTYPE)
    else:
        b = tl.load(ptr + offs[:, None] + d[None, :], mask=mask, other=0)
        x = _fp8_decode(b, 5, 2, 1.52587890625e-05).to(OUT_DTYPE)
    return x


@triton.jit
def _round_even(y):
    """round half to even of float32 |y| < 2**22 (torch.round's rule)."""
    return (y + ROUND_MAGIC) - ROUND_MAGIC


@triton.jit
def _pow2(e):
    """2**e as float32 for an int32 e in the normal range."""
    return _f32_from_bits((e + 127) << 23)


@triton.jit
def _fp8_encode(
    x, MAX: tl.constexpr, EXP_BITS: tl.constexpr, MAN_BITS: tl.constexpr, INV_TINY: tl.constexpr
):
    """float32 -> fp8 bits (int32), clamped to +-MAX, rounded to nearest even (INV_TINY: 1 /
    the smallest subnormal)."""
    bias: tl.constexpr = (1 << (EXP_BITS - 1)) - 1
    a = tl.minimum(tl.abs(x), MAX)
    e = ((a.to(tl.uint32, bitcast=True) >> 23) & 255).to(tl.int32) - 127
    e = tl.maximum(e, 1 - bias)  # below the smallest normal: the subnormals' spacing
    r = _round_even(a * _pow2(MAN_BITS - e)) * _pow2(e - MAN_BITS)  # exact scalings
    rb = r.to(tl.uint32, bitcast=True).to(tl.int32)
    re = ((rb >> 23) & 255) - 127
    normal = ((re + bias) << MAN_BITS) | ((rb >> (23 - MAN_BITS)) & ((1 << MAN_BITS) - 1))
    sub = (r * INV_TINY).to(tl.int32)  # a subnormal's mantissa: r / the smallest one
    bits = tl.where(re < 1 - bias, sub, normal)
    bits = tl.where(r == 0.0, 0, bits)
    return tl.where(x < 0, bits | 128, bits)


@triton.jit
def store_kv_rows(
    ptr,  # the cache (K or V part), at the token's slot
    h,  # [H] arange
    d,  # [D] arange
    x,  # [H, D] the token's rows (any float dtype)
    mask,  # [H, D]
    head_mask,  # [H]
    stride_h,
    head_dim,
    KV_KIND: tl.constexpr,
):
    """Write one token's rows of every KV head, quantized as KV_KIND stores them."""
    dst = ptr + h[:, None] * stride_h + d[None, :]
    if KV_KIND <= 1:
        tl.store(dst, x.to(ptr.dtype.element_ty), mask=mask)
    elif KV_KIND == 2:
        xf = tl.where(mask, x.to(tl.float32), 0.0)
        amax = tl.max(tl.abs(xf), 1)
        scale = tl.where(amax > 0.0, tl.math.div_rn(amax, tl.zeros_like(amax) + 127.0), 1.0)
        y = tl.math.div_rn(xf, scale[:, None])
        q = tl.minimum(tl.maximum(_round_even(y), -127.0), 127.0).to(tl.int32)
        tl.store(dst, q.to(tl.int8), mask=mask)
        bits = scale.to(tl.uint32, bitcast=True)
        scale_at = ptr + h * stride_h + head_dim
        for i in tl.static_range(4):
            byte = ((bits >> (8 * i)) & 255).to(tl.uint8)
            tl.store(scale_at + i, byte.to(tl.int8, bitcast=True), mask=head_mask)
    elif KV_KIND == 3:
        bits = _fp8_encode(x.to(tl.float32), 448.0, 4, 3, 512.0)
        tl.store(dst, bits.to(tl.uint8), mask=mask)
    else:
        bits = _fp8_encode(x.to(tl.float32), 57344.0, 5, 2, 65536.0)
        tl.store(dst, bits.to(tl.uint8), mask=mask)


__all__ = ["load_kv_rows", "store_kv_rows", "triton"]
