"""Extend attention in plain float32 torch: the ground truth for `kernel.extend_attention`."""

from __future__ import annotations

import torch

from gpu_worker.kernels.paged_decode.reference import dequantized, gather_context, sink_softmax


def extend_attention_reference(
    q: torch.Tensor,  # [T, num_heads, head_dim], requests packed
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], new K/V in
    block_tables: torch.Tensor,  # [R, max_blocks] int32
    query_start_loc: torch.Tensor,  # [R + 1] int32, rows of q per request
    seq_lens: torch.Tensor,  # [R] int32, context length including the new tokens
    scale: float,
    window: int = 0,  # sliding window: key j visible to query i when i - window < j
    softcap: float = 0.0,  # scores soft-capped to softcap * tanh(s / softcap); 0 for none
    sinks: torch.Tensor | None = None,  # [num_heads]: a logit per head with no value
    kv_cache_dtype: str = "auto",  # a quantized cache's rows are read back first
) -> torch.Tensor:  # [T, num_heads, head_dim] float32 (rows outside every request: 0)
    """Causal attention of each request's new tokens over its cached context."""
    kv_cache = dequantized(kv_cache, kv_cache_dtype)
    num_heads, num_kv_heads = q.shape[1], kv_cache.shape[3]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    starts = query_start_loc.tolist()
    for r, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[r], starts[r + 1]
        num_computed = seq_len - (end - start)
        k, v = gather_context(kv_cache, block_tables[r], seq_len)
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [L, H, D]
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("qhd,lhd->hql", q[start:end].float(), k) * scale
        if softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        query_pos = torch.arange(num_computed, seq_len, device=q.device)
        key_pos = torch.arange(seq_len, device=q.device)
        visible = key_pos[None, :] <= query_pos[:, None]  # [q_len, L]
        if window > 0:
            visible &= key_pos[None, :] > query_pos[:, None] - window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:end] = torch.einsum("hql,lhd->qhd", sink_softmax(scores, sinks), v)
    return out
