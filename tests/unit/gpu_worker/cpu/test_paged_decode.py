"""The C paged-decode kernel (gpu_worker/cpu/paged_decode.py) against a naive reference."""

from __future__ import annotations

import random

import pytest
import torch

from gpu_worker.attention import build_metadata, create_backend
from gpu_worker.cpu import paged_decode
from tests.unit.gpu_worker.attention.test_torch_backend import naive_attention

torch.set_num_threads(2)

pytestmark = pytest.mark.skipif(paged_decode.load() is None, reason="no C compiler here")


def _case(
    contexts: list[int],
    *,
    block_size: int,
    num_kv_heads: int,
    q_per_kv: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_blocks = sum(-(-c // block_size) for c in contexts) + 8
    free = list(range(num_blocks))
    rng.shuffle(free)  # scattered blocks, as a real pool hands them out
    tables = [[free.pop() for _ in range(-(-c // block_size))] for c in contexts]
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    q = torch.randn(len(contexts), num_kv_heads * q_per_kv, head_dim, generator=gen)
    return q.to(dtype), cache.to(dtype), tables


@pytest.mark.parametrize("num_seqs", [1, 3, 40])  # one KV head per task, or whole sequences
@pytest.mark.parametrize("q_per_kv", [1, 3])
@pytest.mark.parametrize("block_size", [4, 16])
def test_kernel_matches_naive_attention(num_seqs: int, q_per_kv: int, block_size: int) -> None:
    contexts = [1 + (37 * i) % 150 for i in range(num_seqs)]  # 1 .. 150, uneven
    q, cache, tables = _case(
        contexts, block_size=block_size, num_kv_heads=2, q_per_kv=q_per_kv, head_dim=32
    )
    meta = build_metadata([c - 1 for c in contexts], [1] * num_seqs, tables, block_size)
    out = paged_decode.paged_decode(q, cache, meta.block_tables, meta.seq_lens, 32**-0.5)
    ref = naive_attention(q, cache, [c - 1 for c in contexts], [1] * num_seqs, tables)
    assert out is not None
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 128])  # the sizes with a compiled-in loop
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_seqs", [2, 12])  # one KV head per task, or whole sequences
def test_fixed_head_sizes_match_naive_attention(
    head_dim: int, dtype: torch.dtype, num_seqs: int
) -> None:
    contexts = [1 + (53 * i) % 200 for i in range(num_seqs)]
    q, cache, tables = _case(
        contexts, block_size=16, num_kv_heads=3, q_per_kv=3, head_dim=head_dim, dtype=dtype
    )
    meta = build_metadata([c - 1 for c in contexts], [1] * num_seqs, tables, 16)
    scale = head_dim**-0.5
    out = paged_decode.paged_decode(q, cache, meta.block_tables, meta.seq_lens, scale)
    prior = [c - 1 for c in contexts]
    ref = naive_attention(q.float(), cache.float(), prior, [1] * num_seqs, tables)
    assert out is not None and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


def test_head_dim_off_the_vector_width_and_bfloat16() -> None:
    contexts = [5, 17, 33]
    q, cache, tables = _case(
        contexts, block_size=16, num_kv_heads=3, q_per_kv=3, head_dim=72, dtype=torch.bfloat16
    )
    meta = build_metadata([c - 1 for c in contexts], [1] * 3, tables, 16)
    out = paged_decode.paged_decode(q, cache, meta.block_tables, meta.seq_lens, 72**-0.5)
    ref = naive_attention(q.float(), cache.float(), [c - 1 for c in contexts], [1] * 3, tables)
    assert out is not None and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


def test_backend_uses_the_kernel_and_agrees_with_its_eager_path() -> None:
    kwargs = dict(
        num_heads=9, num_kv_heads=3, head_dim=64, dtype=torch.float32, device=torch.device("cpu")
    )
    fast = create_backend("torch", **kwargs)
    eager = create_backend("torch", cpu_decode_kernel=False, **kwargs)
    assert fast.cpu_decode_kernel and not eager.cpu_decode_kernel
    contexts = [300, 7, 64, 129]
    q, cache, tables = _case(contexts, block_size=16, num_kv_heads=3, q_per_kv=3, head_dim=64)
    meta = build_metadata([c - 1 for c in contexts], [1] * 4, tables, 16)
    k = torch.randn(4, 3, 64)
    v = torch.randn(4, 3, 64)
    a = fast.forward(q, k, v, cache.clone(), fast.build_metadata(meta))
    b = eager.forward(q, k, v, cache.clone(), eager.build_metadata(meta))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [32, 64, 128])  # the generic loop and the compiled-in ones
@pytest.mark.parametrize("window", [1, 7, 16, 33])  # inside a block, one block, across blocks
@pytest.mark.parametrize("num_seqs", [3, 40])
def test_sliding_window_matches_naive_attention(head_dim: int, window: int, num_seqs: int) -> None:
    contexts = [1 + (37 * i) % 150 for i in range(num_seqs)]
    q, cache, tables = _case(
        contexts, block_size=16, num_kv_heads=2, q_per_kv=3, head_dim=head_dim, seed=window
    )
    meta = build_metadata([c - 1 for c in contexts], [1] * num_seqs, tables, 16)
    scale = head_dim**-0.5
    out = paged_decode.paged_decode(q, cache, meta.block_tables, meta.seq_lens, scale, window)
    prior = [c - 1 for c in contexts]
    ref = naive_attention(q, cache, prior, [1] * num_seqs, tables, window)
    assert out is not None
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_soft_cap_matches_naive_attention(head_dim: int, dtype: torch.dtype) -> None:
    contexts = [1, 16, 40, 150]
    q, cache, tables = _case(
        contexts, block_size=16, num_kv_heads=2, q_per_kv=2, head_dim=head_dim, dtype=dtype
    )
    q = q * 4  # large scores, which the cap bends
    meta = build_metadata([c - 1 for c in contexts], [1] * 4, tables, 16)
    out = paged_decode.paged_decode(q, cache, meta.block_tables, meta.seq_lens, 0.3, 9, 5.0)
    prior = [c - 1 for c in contexts]
    ref = naive_attention(q.float(), cache.float(), prior, [1] * 4, tables, 9, 0.3, 5.0)
    assert out is not None
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("num_seqs", [3, 40])  # one KV head per task, or whole sequences
def test_sinks_match_naive_attention(head_dim: int, num_seqs: int) -> None:
    contexts = [1 + (37 * i) % 150 for i in range(num_seqs)]
    q, cache, tables = _case(contexts, block_size=16, num_kv_heads=2, q_per_kv=3, head_dim=head_dim)
    sinks = torch.tensor([2.0, -3.0, 0.0, 6.0, 1.5, -0.5])
    meta = build_metadata([c - 1 for c in contexts], [1] * num_seqs, tables, 16)
    scale = head_dim**-0.5
    out = paged_decode.paged_decode(
        q, cache, meta.block_tables, meta.seq_lens, scale, 20, 0.0, sinks
    )
    prior = [c - 1 for c in contexts]
    ref = naive_attention(q, cache, prior, [1] * num_seqs, tables, 20, None, 0.0, sinks)
    assert out is not None
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
