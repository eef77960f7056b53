"""KV store in plain torch: the ground truth for `kernel.store_kv`."""

from __future__ import annotations

import torch


def store_kv_reference(
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,  # [T, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], updated
    slot_mapping: torch.Tensor,  # [T] int64, negative = padding, not stored
) -> None:
    """Copy each token's K/V (cast to the cache's dtype) into its slot."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    kv_cache[0].view(-1, num_kv_heads, head_dim)[slots] = k[keep].to(kv_cache.dtype)
    kv_cache[1].view(-1, num_kv_heads, head_dim)[slots] = v[keep].to(kv_cache.dtype)
