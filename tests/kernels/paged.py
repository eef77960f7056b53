"""Random paged-KV batches for the kernel tests, and naive loops to check references by."""

from __future__ import annotations

import dataclasses
import math
import random

import torch


@dataclasses.dataclass
class PagedBatch:
    """A cache full of random numbers and requests whose blocks are scattered through it."""

    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # [R, max_blocks] int32, padded with block 0
    seq_lens: torch.Tensor  # [R] int32
    tables: list[list[int]]


def paged_batch(
    seq_lens: list[int],
    *,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PagedBatch:
    """Random K/V everywhere, so a kernel reading past a sequence's end would show."""
    rng = random.Random(seed)
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + 3
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in needed]
    block_tables = torch.zeros(len(seq_lens), max(max(needed), 1), dtype=torch.int32)
    for r, table in enumerate(tables):
        block_tables[r, : len(table)] = torch.tensor(table, dtype=torch.int32)
    gen = torch.Generator().manual_seed(seed)
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    cache = torch.randn(shape, generator=gen).to(dtype)
    return PagedBatch(
        kv_cache=cache.to(device),
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        tables=tables,
    )


def randn(*shape: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device)


def naive_attention_row(
    q: list[float],  # [head_dim]
    keys: list[list[float]],  # [L][head_dim]
    values: list[list[float]],  # [L][head_dim]
    scale: float,
) -> list[float]:
    """One query against L keys, scalar by scalar: softmax with its max subtracted."""
    scores = [scale * sum(a * b for a, b in zip(q, k, strict=True)) for k in keys]
    top = max(scores)
    weights = [math.exp(s - top) for s in scores]
    total = sum(weights)
    return [sum(w * v[d] for w, v in zip(weights, values, strict=True)) / total
            for d in range(len(q))]  # fmt: skip


def naive_paged_attention(
    q: torch.Tensor,  # [T, H, D]
    batch: PagedBatch,
    query_lens: list[int],
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Every query token of every request against the keys it may see (its last `window`
    with a sliding window), slot by slot."""
    cache, block_size = batch.kv_cache.cpu().double(), batch.kv_cache.shape[2]
    num_heads, num_kv_heads = q.shape[1], cache.shape[3]
    out = torch.zeros(q.shape, dtype=torch.float64)
    t = 0
    for table, seq_len, q_len in zip(batch.tables, batch.seq_lens.tolist(), query_lens,
                                     strict=True):  # fmt: skip
        for pos in range(seq_len - q_len, seq_len):
            first = max(0, pos - window + 1) if window else 0
            slots = [(table[j // block_size], j % block_size) for j in range(first, pos + 1)]
            for h in range(num_heads):
                g = h // (num_heads // num_kv_heads)
                keys = [cache[0, b, o, g].tolist() for b, o in slots]
                values = [cache[1, b, o, g].tolist() for b, o in slots]
                row = naive_attention_row(q[t, h].double().tolist(), keys, values, scale)
                out[t, h] = torch.tensor(row, dtype=torch.float64)
            t += 1
    return out
