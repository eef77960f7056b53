"""The torch attention backend against a naive per-token loop over the paged cache."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from gpu_worker.attention import build_metadata, create_backend
from gpu_worker.attention.metadata import num_leading_decodes

torch.set_num_threads(2)

HEAD_DIM = 16
NUM_KV_HEADS = 2
NUM_BLOCKS = 96


def naive_attention(
    q: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, KVH, D], new K/V already stored
    num_computed: list[int],
    num_new: list[int],
    block_tables: list[list[int]],
    window: int = 0,
    scale: float | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Token by token: look up every earlier position's K/V through the block table (the
    last `window` positions only, with a sliding window)."""
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    q_per_kv = q.shape[1] // num_kv_heads
    out = torch.empty_like(q)
    t = 0
    for computed, new, table in zip(num_computed, num_new, block_tables, strict=True):
        for pos in range(computed, computed + new):
            first = max(0, pos - window + 1) if window else 0
            slots = [(table[j // block_size], j % block_size) for j in range(first, pos + 1)]
            k = torch.stack([kv_cache[0, b, o] for b, o in slots])  # [pos + 1, KVH, D]
            v = torch.stack([kv_cache[1, b, o] for b, o in slots])
            for h in range(q.shape[1]):
                scale_h = q.shape[-1] ** -0.5 if scale is None else scale
                scores = (k[:, h // q_per_kv].float() @ q[t, h].float()) * scale_h
                if softcap:
                    scores = torch.tanh(scores / softcap) * softcap
                if sinks is not None:  # a key whose value is 0
                    probs = torch.cat((scores, sinks[h : h + 1].float())).softmax(0)[:-1]
                else:
                    probs = scores.softmax(0)
                out[t, h] = (probs @ v[:, h // q_per_kv].float()).to(q.dtype)
            t += 1
    return out


def _run(
    num_computed: list[int],
    num_new: list[int],
    *,
    block_size: int,
    q_per_kv: int,
    dtype: torch.dtype = torch.float32,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    **backend_options: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    num_heads = NUM_KV_HEADS * q_per_kv
    rng = random.Random(0)
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    tables = [
        [free.pop() for _ in range(-(-(c + n) // block_size))]
        for c, n in zip(num_computed, num_new, strict=True)
    ]
    # random everywhere, so stale slots past a sequence's end would show if not masked
    cache = torch.randn(2, NUM_BLOCKS, block_size, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    total = sum(num_new)
    q = torch.randn(total, num_heads, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    backend = create_backend(
        "torch",
        num_heads=num_heads,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=dtype,
        device=torch.device("cpu"),
        **backend_options,
    )
    meta = backend.build_metadata(build_metadata(num_computed, num_new, tables, block_size))
    ours_cache = cache.clone()
    out = backend.forward(q, k, v, ours_cache, meta, window, sinks)
    ref_cache = cache.clone()
    for slot, kk, vv in zip(meta.slot_mapping.tolist(), k, v, strict=True):
        ref_cache[0, slot // block_size, slot % block_size] = kk
        ref_cache[1, slot // block_size, slot % block_size] = vv
    assert torch.equal(ours_cache, ref_cache), "K/V stored in the wrong slots"
    scale, softcap = backend_options.get("scale"), backend_options.get("softcap", 0.0)
    naive = naive_attention(
        q, ref_cache, num_computed, num_new, tables, window, scale, softcap, sinks
    )
    return out, naive


@pytest.mark.parametrize("q_per_kv", [1, 3])
@pytest.mark.parametrize("block_size", [4, 16])
def test_decodes(block_size: int, q_per_kv: int) -> None:
    contexts = [1, block_size - 1, block_size, block_size + 1, 100]
    out, ref = _run([c - 1 for c in contexts], [1] * 5, block_size=block_size, q_per_kv=q_per_kv)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_per_kv", [1, 3])
@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_and_extend(block_size: int, q_per_kv: int) -> None:
    num_computed = [0, 0, block_size - 1, block_size, 3, 60]
    num_new = [block_size + 1, 3, 2, block_size, block_size * 2 + 1, 40]
    out, ref = _run(num_computed, num_new, block_size=block_size, q_per_kv=q_per_kv)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_per_kv", [1, 3])
def test_decodes_and_extends_in_one_batch(q_per_kv: int) -> None:
    num_computed = [0, 14, 15, 16, 99, 0, 7, 31]
    num_new = [1, 1, 1, 1, 1, 20, 9, 5]
    out, ref = _run(num_computed, num_new, block_size=16, q_per_kv=q_per_kv)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_bfloat16_close_to_float32_reference() -> None:
    out, ref = _run([0, 15, 40], [1, 1, 12], block_size=16, q_per_kv=3, dtype=torch.bfloat16)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_metadata_packs_positions_and_slots() -> None:
    #   request 0: 2 cached + 3 new in blocks [7, 2] of 4    request 1: decode at position 5
    meta = build_metadata([2, 5], [3, 1], [[7, 2], [1, 9]], block_size=4)
    assert meta.positions.tolist() == [2, 3, 4, 5]
    assert meta.slot_mapping.tolist() == [7 * 4 + 2, 7 * 4 + 3, 2 * 4 + 0, 9 * 4 + 1]
    assert meta.query_start_loc.tolist() == [0, 3, 4]
    assert meta.seq_lens.tolist() == [5, 6]
    assert meta.block_tables.tolist() == [[7, 2], [1, 9]]
    assert meta.num_decodes == 0  # the decode is not at the front
    assert num_leading_decodes([1, 1, 4, 1]) == 2


@pytest.mark.parametrize("chunk", [3, 300])  # listed in Python / as tensors (> 256 tokens)
def test_metadata_slots_of_every_token(chunk: int) -> None:
    num_computed, num_new = [5, 0, 17], [1, chunk, 2]
    tables = [[4, 8], [int(b) for b in torch.randperm(40)[:19] + 10], [3, 1]]
    meta = build_metadata(num_computed, num_new, tables, block_size=16)
    want = [
        (p, tables[r][p // 16] * 16 + p % 16)
        for r, (c, n) in enumerate(zip(num_computed, num_new, strict=True))
        for p in range(c, c + n)
    ]
    assert meta.positions.dtype == meta.slot_mapping.dtype == torch.int64
    assert list(zip(meta.positions.tolist(), meta.slot_mapping.tolist(), strict=True)) == want
    assert meta.num_computed.tolist() == num_computed
    assert meta.block_tables.dtype == torch.int32 and meta.block_tables.shape == (3, 19)


def test_metadata_rejects_too_few_blocks() -> None:
    with pytest.raises(ValueError, match="cannot hold"):
        build_metadata([4], [1], [[3]], block_size=4)


# every path of the backend: the C decode kernel (rows of a chunk too, when batch-invariant),
# and the eager gather + SDPA
PATHS = {
    "c-kernel": {},
    "eager": {"cpu_decode_kernel": False},
    "batch-invariant": {"batch_invariant": True},
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("window", [1, 5, 16, 40])
def test_sliding_window_in_a_mixed_batch(path: str, window: int) -> None:
    """Decodes and chunks (from 0, and after a cached prefix) of contexts shorter than,
    equal to and many times the window: each query sees its last `window` positions."""
    num_computed = [0, 4, 15, 39, 99, 0, 7, 31, 60]
    num_new = [1, 1, 1, 1, 1, 50, 9, 5, 40]
    out, ref = _run(num_computed, num_new, block_size=4, q_per_kv=3, window=window, **PATHS[path])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", PATHS)
def test_window_wider_than_every_context_changes_nothing(path: str) -> None:
    args = ([0, 14, 3], [20, 1, 9])
    full, _ = _run(*args, block_size=4, q_per_kv=1, **PATHS[path])
    wide, _ = _run(*args, block_size=4, q_per_kv=1, window=64, **PATHS[path])
    assert torch.equal(full, wide)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("window", [0, 5])
def test_soft_cap_and_scale_in_a_mixed_batch(path: str, window: int) -> None:
    """Gemma 2's attention: scores * query_pre_attn_scalar ** -0.5, capped at 2 (small, so
    the cap bends most scores), on every path, with and without a window."""
    num_computed = [0, 4, 39, 0, 7, 31]
    num_new = [1, 1, 1, 30, 9, 5]
    options = {**PATHS[path], "scale": 0.4, "softcap": 2.0}
    out, ref = _run(num_computed, num_new, block_size=4, q_per_kv=3, window=window, **options)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    plain, _ = _run(num_computed, num_new, block_size=4, q_per_kv=3, window=window, scale=0.4)
    assert (plain - out).abs().max() > 1e-2  # the cap changed the outputs


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_sinks_in_a_mixed_batch(path: str, softcap: float) -> None:
    """gpt-oss's attention sinks: a logit per head (some large, so they take most of the
    weight) in each softmax, on every path, windowed and soft-capped too."""
    sinks = torch.tensor([3.0, -1.0, 0.5, 8.0, -20.0, 1.0])
    num_computed, num_new = [0, 4, 39, 0, 7, 31], [1, 1, 1, 30, 9, 5]
    options = {**PATHS[path], "softcap": softcap}
    for window in (0, 5):
        out, ref = _run(num_computed, num_new, block_size=4, q_per_kv=3, window=window,
                        sinks=sinks, **options)  # fmt: skip
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    plain, _ = _run(num_computed, num_new, block_size=4, q_per_kv=3, **options)
    assert (plain - out).abs().max() > 1e-2
