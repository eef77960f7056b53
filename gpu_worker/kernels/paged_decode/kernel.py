"""Paged decode attention in Triton: split-K (flash-decoding) with a log-sum-exp merge.

See the package docstring for the method. Scores are kept in log2 units (q is scaled by
`scale * log2(e)`) so the softmax uses exp2, which is what the hardware computes natively.
With a sliding window (`window` > 0) the splits share out only the last `window` positions
of each context; the positions before are never read. With a soft cap (`softcap` > 0,
Gemma 2) each score becomes softcap * tanh(score / softcap) before the softmax; in log2 units
that is the same with the cap times log2(e). Attention sinks (gpt-oss: a logit per head) join
at the merge, as one more split with no value.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from gpu_worker.kernels import check_device, check_paged_attention, dot_precision, next_power_of_2
from gpu_worker.kernels.kv_rows import load_kv_rows
from gpu_worker.kv_quant import KVFormat

DEFAULT_NUM_SPLITS = 16
_LOG2E = math.log2(math.e)


@triton.jit
def soft_cap(x, cap):
    """cap * tanh(x / cap), tanh from exp2 (stable: e^(-2|y|) never overflows)."""
    y = x / cap
    t = tl.math.exp2(-2.8853900817779268 * tl.abs(y))  # e^(-2|y|): 2 * log2(e)
    th = (1.0 - t) / (1.0 + t)
    return cap * tl.where(y < 0, -th, th)


@triton.jit
def _window_start(seq_len, window):
    """The first position the query (at seq_len - 1) sees: 0, or seq_len - window."""
    return tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)


@triton.jit
def _split_len(seq_len, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Tokens per split: an equal share of the context, rounded up to whole tiles."""
    per_split = tl.cdiv(seq_len, NUM_SPLITS)
    return tl.maximum(tl.cdiv(per_split, BLOCK_N), 1) * BLOCK_N


@triton.jit
def _decode_split_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    part_o_ptr,  # [B, num_heads, NUM_SPLITS, head_dim] float32
    part_lse_ptr,  # [B, num_heads, NUM_SPLITS] float32, log2 units
    qk_scale,  # scale * log2(e)
    window,  # sliding window, 0 for the whole context
    softcap,  # soft cap in log2 units (cap * log2(e)), 0 for none
    stride_qb,
    stride_qh,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_h,
    stride_bt,
    num_heads,
    q_per_kv,
    num_head_blocks,  # ceil(q_per_kv / BLOCK_H)
    block_size,
    head_dim,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_KIND: tl.constexpr,  # how rows are stored (gpu_worker/kernels/kv_rows.py)
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1) // num_head_blocks
    group_row = (tl.program_id(1) % num_head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    heads = kv_head * q_per_kv + group_row  # the query heads this program serves
    head_mask = group_row < q_per_kv
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim

    seq_len = tl.load(seq_lens_ptr + b)
    first = _window_start(seq_len, window)
    split_len = _split_len(seq_len - first, NUM_SPLITS, BLOCK_N)
    start = first + split * split_len
    end = tl.minimum(start + split_len, seq_len)
    if start < end:  # later splits of a short context have nothing to do
        q_offs = b * stride_qb + heads[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr + q_offs, mask=head_mask[:, None] & d_mask[None, :], other=0.0)
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        bt_row = block_tables_ptr + b * stride_bt
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            pos_mask = pos < end
            block = tl.load(bt_row + pos // block_size, mask=pos_mask, other=0).to(tl.int64)
            offs = block * stride_cache_block + (pos % block_size) * stride_cache_slot
            offs = offs + kv_head * stride_cache_h
            kv_mask = pos_mask[:, None] & d_mask[None, :]
            k = load_kv_rows(cache_ptr, offs, d, kv_mask, pos_mask, head_dim, KV_KIND, q.dtype)
            v = load_kv_rows(
                cache_ptr + stride_cache_kv, offs, d, kv_mask, pos_mask, head_dim, KV_KIND, q.dtype
            )
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            if softcap > 0:
                qk = soft_cap(qk, softcap)
            qk = tl.where(pos_mask[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.math.exp2(qk - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        part = (b * num_heads + heads) * NUM_SPLITS + split  # [BLOCK_H]
        o = acc / l_i[:, None]
        tl.store(
            part_o_ptr + part[:, None] * head_dim + d[None, :],
            o,
            mask=head_mask[:, None] & d_mask[None, :],
        )
        tl.store(part_lse_ptr + part, m_i + tl.math.log2(l_i), mask=head_mask)


@triton.jit
def _decode_merge_kernel(
    part_o_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    sinks_ptr,  # [num_heads] float32, read when HAS_SINKS
    out_ptr,
    window,
    stride_ob,
    stride_oh,
    num_heads,
    head_dim,
    NUM_SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    span = seq_len - _window_start(seq_len, window)  # the positions the splits share out
    num_active = tl.cdiv(span, _split_len(span, NUM_SPLITS, BLOCK_N))
    s = tl.arange(0, NUM_SPLITS)
    s_mask = s < num_active  # inactive splits wrote nothing: never read them
    d = tl.arange(0, BLOCK_D)
    part = (b * num_heads + h) * NUM_SPLITS + s
    lse = tl.load(part_lse_ptr + part, mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    if HAS_SINKS:  # the sink's logit, in log2 units like the splits' sums
        sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
        lse_max = tl.maximum(lse_max, sink)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # seq_len 0: output zeros
    w = tl.math.exp2(lse - lse_max)
    o_mask = s_mask[:, None] & (d[None, :] < head_dim)
    o = tl.load(part_o_ptr + part[:, None] * head_dim + d[None, :], mask=o_mask, other=0.0)
    total = tl.sum(w, 0)
    if HAS_SINKS:
        total += tl.math.exp2(sink - lse_max)
    total = tl.where(total > 0.0, total, 1.0)
    merged = tl.sum(o * w[:, None], 0) / total
    dst = out_ptr + b * stride_ob + h * stride_oh + d
    tl.store(dst, merged.to(out_ptr.dtype.element_ty), mask=d < head_dim)


def decode_tiles(q_per_kv: int, head_dim: int, element_size: int) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_N, BLOCK_D): tl.dot wants 16 rows at least, so small query groups
    are padded with masked heads; K/V tiles of 32 tokens when a row is wide (fp32, 128
    dims) keep two pipeline stages in shared memory."""
    block_d = max(16, next_power_of_2(head_dim))
    block_n = 64 if block_d * element_size <= 256 else 32
    return max(16, min(64, next_power_of_2(q_per_kv))), block_n, block_d


def _check_inputs(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    kv_cache_dtype: str = "auto",
) -> None:
    num_seqs = q.shape[0]
    check_paged_attention(q, kv_cache, out, block_tables, num_seqs, kv_cache_dtype)
    assert seq_lens.shape == (num_seqs,) and seq_lens.dtype == torch.int32, "bad seq_lens"
    check_device(q, kv_cache, block_tables, seq_lens, out)


def paged_decode(
    q: torch.Tensor,  # [B, num_heads, head_dim], head_dim contiguous
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], contiguous
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32, context length including the new token
    scale: float,
    *,
    window: int = 0,  # sliding window: the last `window` positions only; 0 for all
    softcap: float = 0.0,  # scores soft-capped to softcap * tanh(s / softcap); 0 for none
    sinks: torch.Tensor | None = None,  # [num_heads] float32: a logit per head with no value
    kv_cache_dtype: str = "auto",  # how rows are stored (gpu_worker/kv_quant.py)
    num_splits: int = DEFAULT_NUM_SPLITS,
    out: torch.Tensor | None = None,  # [B, num_heads, head_dim], written if given
    block_n: int | None = None,
) -> torch.Tensor:
    """Attention of each sequence's one new query over its paged context (its last `window`
    positions with a sliding window)."""
    out = torch.empty_like(q) if out is None else out
    _check_inputs(q, kv_cache, block_tables, seq_lens, out, kv_cache_dtype)
    fmt = KVFormat.create(kv_cache_dtype, q.dtype)
    assert num_splits >= 1 and num_splits & (num_splits - 1) == 0, "num_splits: a power of 2"
    assert window >= 0 and softcap >= 0, "window, softcap: 0 (none) or positive"
    num_seqs, num_heads, head_dim = q.shape
    if num_seqs == 0:
        return out
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    q_per_kv = num_heads // num_kv_heads
    block_h, default_block_n, block_d = decode_tiles(q_per_kv, head_dim, q.element_size())
    block_n = block_n or default_block_n
    num_head_blocks = -(-q_per_kv // block_h)
    part_o = torch.empty(
        (num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
    )
    part_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
    grid = (num_seqs, num_kv_heads * num_head_blocks, num_splits)
    _decode_split_kernel[grid](
        q, kv_cache, block_tables, seq_lens, part_o, part_lse, scale * _LOG2E, window,
        softcap * _LOG2E, q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        num_heads, q_per_kv, num_head_blocks, block_size, head_dim,
        NUM_SPLITS=num_splits, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=block_d,
        DOT_PRECISION=dot_precision(q.dtype), KV_KIND=fmt.kind,
        num_warps=4, num_stages=2,
    )  # fmt: skip
    if sinks is not None:
        assert sinks.shape == (num_heads,) and sinks.dtype == torch.float32, "sinks: [H] fp32"
        check_device(q, sinks)
    _decode_merge_kernel[(num_seqs, num_heads)](
        part_o, part_lse, seq_lens, part_lse if sinks is None else sinks, out, window,
        out.stride(0), out.stride(1), num_heads, head_dim,
        NUM_SPLITS=num_splits, BLOCK_N=block_n, BLOCK_D=block_d, HAS_SINKS=sinks is not None,
        num_warps=4,
    )  # fmt: skip
    return out
