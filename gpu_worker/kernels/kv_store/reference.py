"""KV store in plain torch: the ground truth for `kernel.store_kv`."""

from __future__ import annotations

import torch


def store_kv_reference(
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,  # [T, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], updated
    slot_mapping: torch.Tensor,  # [T] int64, negative = padding, not stored
    kv_cache_dtype: str = "auto",  # rows quantized as gpu_worker/kv_quant.py stores them
) -> None:
    """Copy each token's K/V (cast to the cache's dtype, or quantized) into its slot."""
    from gpu_worker.kv_quant import KVFormat

    fmt = KVFormat.create(kv_cache_dtype, kv_cache.dtype)
    num_kv_heads, row = kv_cache.shape[-2:]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    kv_cache[0].view(-1, num_kv_heads, row)[slots] = fmt.quantize(k[keep]).to(kv_cache.dtype)
    kv_cache[1].view(-1, num_kv_heads, row)[slots] = fmt.quantize(v[keep]).to(kv_cache.dtype)
