"""KV store in Triton: one program per token copies its K and V rows (all KV heads),
quantized as they are written when the cache is (gpu_worker/kernels/kv_rows.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_worker.kernels import check_device, next_power_of_2
from gpu_worker.kernels.kv_rows import store_kv_rows
from gpu_worker.kv_quant import KVFormat


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_kv,  # K -> V
    stride_cache_slot,  # one slot = num_kv_heads * head_dim elements (cache is contiguous)
    stride_cache_h,
    num_kv_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_KIND: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:  # negative: a padded token, stored nowhere
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        mask = (h[:, None] < num_kv_heads) & (d[None, :] < head_dim)
        k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
        v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
        dst = cache_ptr + slot.to(tl.int64) * stride_cache_slot
        head_mask = h < num_kv_heads
        store_kv_rows(dst, h, d, k, mask, head_mask, stride_cache_h, head_dim, KV_KIND)
        store_kv_rows(
            dst + stride_cache_kv, h, d, v, mask, head_mask, stride_cache_h, head_dim, KV_KIND
        )


def store_kv(
    k: torch.Tensor,  # [T, num_kv_heads, head_dim], head_dim contiguous (a view is fine)
    v: torch.Tensor,  # [T, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, row], contiguous
    slot_mapping: torch.Tensor,  # [T] int64, negative = padding
    kv_cache_dtype: str = "auto",  # how rows are stored (gpu_worker/kv_quant.py)
) -> None:
    """Write k and v into kv_cache at slot_mapping (in place), each row quantized once as
    `kv_cache_dtype` stores it."""
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, f"kv_cache {tuple(kv_cache.shape)}"
    assert kv_cache.is_contiguous(), "kv_cache must be contiguous"
    fmt = KVFormat.create(kv_cache_dtype, k.dtype)
    num_kv_heads, head_dim = kv_cache.shape[3], fmt.head_dim(kv_cache.shape[4])
    num_tokens = k.shape[0]
    for name, x in (("k", k), ("v", v)):
        assert x.shape == (num_tokens, num_kv_heads, head_dim), f"{name} {tuple(x.shape)}"
        assert x.stride(2) == 1, f"{name} needs a contiguous head_dim"
        want = fmt.storage_dtype
        assert fmt.quantized or x.dtype == want, f"{name} is {x.dtype}, cache {kv_cache.dtype}"
    assert kv_cache.dtype == fmt.storage_dtype, f"cache {kv_cache.dtype} for {kv_cache_dtype}"
    assert slot_mapping.shape == (num_tokens,), f"slot_mapping {tuple(slot_mapping.shape)}"
    assert slot_mapping.dtype == torch.int64, f"slot_mapping is {slot_mapping.dtype}, not int64"
    check_device(k, v, kv_cache, slot_mapping)
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        kv_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(2),
        kv_cache.stride(3),
        num_kv_heads,
        head_dim,
        BLOCK_H=next_power_of_2(num_kv_heads),
        BLOCK_D=next_power_of_2(head_dim),
        KV_KIND=fmt.kind,
    )
