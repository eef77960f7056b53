"""Extend (prefill) attention in Triton over the paged cache; see the package docstring."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from gpu_worker.kernels import check_device, check_paged_attention, dot_precision, next_power_of_2
from gpu_worker.kernels.kv_rows import load_kv_rows
from gpu_worker.kernels.paged_decode.kernel import soft_cap
from gpu_worker.kv_quant import KVFormat

_LOG2E = math.log2(math.e)


@triton.jit
def _extend_kernel(
    q_ptr,
    cache_ptr,
    out_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    sinks_ptr,  # [num_heads] float32, read when HAS_SINKS
    qk_scale,  # scale * log2(e): scores in log2 units, softmax by exp2
    window,  # sliding window: key j visible to query i when i - window < j; 0 for none
    softcap,  # soft cap in log2 units (cap * log2(e)), 0 for none
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_h,
    stride_bt,
    q_per_kv,
    block_size,
    head_dim,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_KIND: tl.constexpr,  # how rows are stored (gpu_worker/kernels/kv_rows.py)
    HAS_SINKS: tl.constexpr,
):
    r = tl.program_id(0)
    head = tl.program_id(1)
    m_block = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + r)
    q_len = tl.load(query_start_loc_ptr + r + 1) - q_start
    if m_block * BLOCK_M < q_len:  # requests shorter than the longest launch idle programs
        seq_len = tl.load(seq_lens_ptr + r)
        num_computed = seq_len - q_len
        kv_head = head // q_per_kv
        rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < q_len
        d = tl.arange(0, BLOCK_D)
        d_mask = d < head_dim
        q_offs = (q_start + rows)[:, None] * stride_qt + head * stride_qh + d[None, :]
        q = tl.load(q_ptr + q_offs, mask=row_mask[:, None] & d_mask[None, :], other=0.0)
        query_pos = num_computed + rows
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        if HAS_SINKS:  # the sink starts the softmax: a key of weight exp(sink), no value
            sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634  # log2 units
            m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + sink
            l_i += 1.0
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        bt_row = block_tables_ptr + r * stride_bt
        # the last key any row of this tile may see (causal), and the first (its window)
        end = tl.minimum(seq_len, num_computed + (m_block + 1) * BLOCK_M)
        lo = tl.where(window > 0, tl.maximum(num_computed + m_block * BLOCK_M - window + 1, 0), 0)
        for n0 in range(lo, end, BLOCK_N):
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
            visible = pos_mask[None, :] & (pos[None, :] <= query_pos[:, None])
            in_window = (window <= 0) | (pos[None, :] > query_pos[:, None] - window)
            qk = tl.where(visible & in_window, qk, float("-inf"))
            # with a window a row may see nothing in the first tiles: m_new is then -inf, and
            # its p and alpha are taken against 0 (they are 0, not exp2(-inf + inf) = NaN)
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(qk - m_ref[:, None])
            alpha = tl.math.exp2(m_i - m_ref)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # padding rows may have seen nothing
        o_offs = (q_start + rows)[:, None] * stride_ot + head * stride_oh + d[None, :]
        o_mask = row_mask[:, None] & d_mask[None, :]
        tl.store(out_ptr + o_offs, o.to(out_ptr.dtype.element_ty), mask=o_mask)


def extend_tiles(head_dim: int, element_size: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D): 64 query rows; K/V tiles of 32 tokens when a row is wide
    (fp32, 128 dims) so two pipeline stages fit in shared memory; 16 at least for tl.dot."""
    block_d = max(16, next_power_of_2(head_dim))
    return 64, 64 if block_d * element_size <= 256 else 32, block_d


def _check_inputs(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    out: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_cache_dtype: str = "auto",
) -> None:
    num_reqs = seq_lens.shape[0]
    check_paged_attention(q, kv_cache, out, block_tables, num_reqs, kv_cache_dtype)
    assert seq_lens.dim() == 1 and seq_lens.dtype == torch.int32, "bad seq_lens"
    assert query_start_loc.shape == (num_reqs + 1,), "query_start_loc needs R + 1 entries"
    assert query_start_loc.dtype == torch.int32, "query_start_loc must be int32"
    check_device(q, kv_cache, out, block_tables, query_start_loc, seq_lens)


def extend_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim], head_dim contiguous
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], contiguous
    block_tables: torch.Tensor,  # [R, max_blocks] int32
    query_start_loc: torch.Tensor,  # [R + 1] int32, absolute rows of q (need not start at 0)
    seq_lens: torch.Tensor,  # [R] int32, context including the new tokens
    scale: float,
    *,
    max_query_len: int,  # the longest request's new tokens (a host number: sizes the grid)
    window: int = 0,  # sliding window: the last `window` positions of each query; 0 for all
    softcap: float = 0.0,  # scores soft-capped to softcap * tanh(s / softcap); 0 for none
    sinks: torch.Tensor | None = None,  # [num_heads] float32: a logit per head with no value
    kv_cache_dtype: str = "auto",  # how rows are stored (gpu_worker/kv_quant.py)
    out: torch.Tensor | None = None,  # [T, num_heads, head_dim]; rows outside requests kept
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Causal attention of the requests' new tokens over their paged context (K/V stored),
    each query over its last `window` positions with a sliding window."""
    out = torch.empty_like(q) if out is None else out
    _check_inputs(q, kv_cache, out, block_tables, query_start_loc, seq_lens, kv_cache_dtype)
    fmt = KVFormat.create(kv_cache_dtype, q.dtype)
    num_reqs = seq_lens.shape[0]
    if num_reqs == 0 or max_query_len == 0:
        return out
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    default_m, default_n, block_d = extend_tiles(head_dim, q.element_size())
    block_m, block_n = block_m or default_m, block_n or default_n
    grid = (num_reqs, num_heads, triton.cdiv(max_query_len, block_m))
    if sinks is not None:
        assert sinks.shape == (num_heads,) and sinks.dtype == torch.float32, "sinks: [H] fp32"
        check_device(q, sinks)
    _extend_kernel[grid](
        q, kv_cache, out, block_tables, query_start_loc, seq_lens,
        seq_lens if sinks is None else sinks, scale * _LOG2E, window,
        softcap * _LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        num_heads // num_kv_heads, block_size, head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        DOT_PRECISION=dot_precision(q.dtype), KV_KIND=fmt.kind, HAS_SINKS=sinks is not None,
        num_warps=4, num_stages=2,
    )  # fmt: skip
    return out
