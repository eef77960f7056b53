"""KV store: kernel vs reference (padding slots skipped), reference vs a per-token loop."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from gpu_worker.kernels.kv_store.kernel import store_kv  # noqa: E402
from gpu_worker.kernels.kv_store.reference import store_kv_reference  # noqa: E402
from tests.kernels.paged import randn  # noqa: E402


def _inputs(num_kv_heads: int, head_dim: int, device: torch.device):
    cache = randn(2, 6, 4, num_kv_heads, head_dim, seed=0, device=device)
    # k and v as strided views of one fused projection, as the model produces them
    kv = randn(7, 2 * num_kv_heads * head_dim + 5, seed=1, device=device)
    k = kv[:, : num_kv_heads * head_dim].view(7, num_kv_heads, head_dim)
    v = kv[:, num_kv_heads * head_dim : -5].view(7, num_kv_heads, head_dim)
    slots = torch.tensor([3, -1, 17, 23, 0, -1, 12], dtype=torch.int64, device=device)
    return cache, k, v, slots


@pytest.mark.parametrize("num_kv_heads, head_dim", [(3, 64), (1, 128)])
def test_matches_reference_and_skips_padding(num_kv_heads, head_dim, device) -> None:
    cache, k, v, slots = _inputs(num_kv_heads, head_dim, device)
    ours, ref = cache.clone(), cache.clone()
    store_kv(k, v, ours, slots)
    store_kv_reference(k, v, ref, slots)
    assert torch.equal(ours, ref)
    assert not torch.equal(ours, cache)


def test_reference_matches_loop() -> None:
    cache, k, v, slots = _inputs(2, 8, torch.device("cpu"))
    ref, loop = cache.clone(), cache.clone()
    store_kv_reference(k, v, ref, slots)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:  # padding writes nowhere
            loop[0, slot // 4, slot % 4] = k[t]
            loop[1, slot // 4, slot % 4] = v[t]
    assert torch.equal(ref, loop)


def test_launcher_rejects_bad_inputs(device) -> None:
    cache, k, v, slots = _inputs(2, 8, device)
    with pytest.raises(AssertionError, match="int64"):
        store_kv(k, v, cache, slots.int())
    with pytest.raises(AssertionError, match="contiguous"):
        store_kv(k, v, cache.transpose(1, 2), slots)
