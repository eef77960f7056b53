"""Paged decode attention without copying the KV: one `torch.compile`d kernel (CPU).

The eager way gathers every decode's blocks into a fresh buffer and runs SDPA over it, so
each step copies its whole KV once and reads it twice. Written as elementwise ops and
reductions, the block-table lookup becomes an indirect load inside inductor's loops: each
K/V row is read once, where it lies in the cache, and nothing is materialised.

    q  [n, kv_heads, q_per_kv, d]                        (GQA folded: each KV head serves
    K  cache[block_tables[n, l // bs], l % bs, kv_head]   its q_per_kv query rows)
    s  [n, L, kv_heads, q_per_kv] = (q . K) * scale, -inf at l >= seq_len; softmax over L
    o  [n, kv_heads, q_per_kv, d] = sum_l p * V

Scores and the softmax are float32 whatever the cache dtype, as SDPA does. Sizes of 0 or 1
are padded to 2 (a copy of row 0, a second block column masked out) so that one compiled
graph, dynamic in n and L, serves every batch: dynamo would otherwise specialise on 1.
If compiling fails (no C++ compiler, an unsupported platform), `paged_decode` returns None
and the caller keeps its eager path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

_compiled: Callable[..., torch.Tensor] | None = None
_broken = False


def _decode_math(
    q: torch.Tensor,  # [n, kv_heads, q_per_kv, d]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, d]
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, d]
    block_tables: torch.Tensor,  # [n, max_blocks] int32
    seq_lens: torch.Tensor,  # [n] int32
    scale: float,
) -> torch.Tensor:  # [n, kv_heads, q_per_kv, d], q's dtype
    n, kv_heads, q_per_kv, d = q.shape
    length = block_tables.shape[1] * k_cache.shape[1]
    table = block_tables.long()
    k = k_cache[table].view(n, length, kv_heads, 1, d).float()
    s = (q.float()[:, None] * k).sum(-1) * scale  # [n, L, kv_heads, q_per_kv]
    beyond = torch.arange(length, device=q.device)[None, :] >= seq_lens[:, None]
    s = s.masked_fill(beyond[:, :, None, None], float("-inf"))
    p = torch.softmax(s, dim=1)
    v = v_cache[table].view(n, length, kv_heads, 1, d).float()
    return (p[..., None] * v).sum(1).to(q.dtype)


def _kernel() -> Callable[..., torch.Tensor] | None:
    global _compiled
    if _compiled is None and not _broken:
        _compiled = torch.compile(_decode_math, dynamic=True, fullgraph=True)
    return _compiled


def paged_decode(
    q: torch.Tensor,  # [n, kv_heads, q_per_kv, d]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, d]
    block_tables: torch.Tensor,  # [n, max_blocks] int32, first blocks cover seq_lens
    seq_lens: torch.Tensor,  # [n] int32, >= 1
    scale: float,
) -> torch.Tensor | None:
    """Attention of one query token per sequence over its paged context; None if the
    compiled kernel is unavailable (the caller falls back to its eager path)."""
    global _broken
    kernel = _kernel()
    if kernel is None:
        return None
    n = q.shape[0]
    if n < 2:  # pad the batch: row 1 repeats row 0, its output is dropped
        q, block_tables, seq_lens = (torch.cat([t, t]) for t in (q, block_tables, seq_lens))
    if block_tables.shape[1] < 2:  # a second block column, never attended (l >= seq_len)
        block_tables = torch.cat([block_tables, block_tables], dim=1)
    try:
        out = kernel(q, kv_cache[0], kv_cache[1], block_tables, seq_lens, scale)
    except Exception as e:  # noqa: BLE001  (any compiler failure: fall back, once, loudly)
        _broken = True
        log.warning("compiled paged decode unavailable, using the eager path: %s", e)
        return None
    return out[:n]


def warm_up(num_kv_heads: int, q_per_kv: int, head_dim: int, dtype: torch.dtype,
            device: torch.device | str = "cpu") -> bool:
    """Compile now (seconds, once per process and shape family) rather than on the first
    request's step; True if the compiled kernel is in use."""
    cache = torch.zeros(2, 4, 16, num_kv_heads, head_dim, dtype=dtype, device=device)
    q = torch.zeros(2, num_kv_heads, q_per_kv, head_dim, dtype=dtype, device=device)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device)
    lens = torch.tensor([17, 5], dtype=torch.int32, device=device)
    return paged_decode(q, cache, tables, lens, head_dim**-0.5) is not None


def is_broken() -> bool:
    return _broken


def _reset_for_tests(**state: Any) -> None:
    """Tests switch the compiled path off and on."""
    global _broken, _compiled
    _broken = state.get("broken", False)
    _compiled = None
