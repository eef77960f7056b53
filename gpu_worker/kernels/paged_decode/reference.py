"""Paged decode attention in plain float32 torch: the ground truth for `kernel.paged_decode`."""

from __future__ import annotations

import torch


def gather_context(
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [max_blocks] int32
    seq_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one sequence's first `seq_len` tokens: [seq_len, num_kv_heads, head_dim]."""
    block_size = kv_cache.shape[2]
    num_blocks = -(-seq_len // block_size)
    blocks = block_table[:num_blocks].long()
    k = kv_cache[0, blocks].flatten(0, 1)[:seq_len]
    v = kv_cache[1, blocks].flatten(0, 1)[:seq_len]
    return k.float(), v.float()


def paged_decode_reference(
    q: torch.Tensor,  # [B, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32, tokens of context (the new one included)
    scale: float,
    window: int = 0,  # sliding window: the last `window` positions only; 0 for all
    softcap: float = 0.0,  # scores soft-capped to softcap * tanh(s / softcap); 0 for none
    sinks: torch.Tensor | None = None,  # [num_heads]: a logit per head with no value
    kv_cache_dtype: str = "auto",  # a quantized cache's rows are read back first
) -> torch.Tensor:  # [B, num_heads, head_dim] float32
    """softmax(q K^T * scale) V per sequence, in float32, with GQA by repeating K/V heads."""
    kv_cache = dequantized(kv_cache, kv_cache_dtype)
    num_heads, num_kv_heads = q.shape[1], kv_cache.shape[3]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for b, seq_len in enumerate(seq_lens.tolist()):
        k, v = gather_context(kv_cache, block_tables[b], seq_len)
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [L, H, D]
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b].float(), k) * scale
        if softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        if window > 0:
            scores[:, : max(0, seq_len - window)] = float("-inf")
        out[b] = torch.einsum("hl,lhd->hd", sink_softmax(scores, sinks), v)
    return out


def dequantized(kv_cache: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    """The cache's rows as float32 (gpu_worker/kv_quant.py); a float cache as it is."""
    from gpu_worker.kv_quant import KVFormat

    fmt = KVFormat.create(kv_cache_dtype, torch.float32)
    return fmt.dequantize(kv_cache, torch.float32) if fmt.quantized else kv_cache


def sink_softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last dimension of scores [H, ..., L]; with sinks [H], each head's
    sink joins as one more column whose weight is then dropped (it has no value)."""
    if sinks is None:
        return scores.softmax(dim=-1)
    column = sinks.float().view(-1, *([1] * (scores.dim() - 1))).expand(*scores.shape[:-1], 1)
    return torch.cat((scores, column), dim=-1).softmax(dim=-1)[..., :-1]
