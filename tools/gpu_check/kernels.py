"""gpu-check, kernel part: each kernel against its reference, decode bytes/s, extend TFLOP/s.

Imported only after cli.py has decided whether Triton interprets (CPU) or
compiles (CUDA). Needs torch and triton only.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from gpu_worker.kernels.extend_attention.kernel import extend_attention
from gpu_worker.kernels.extend_attention.reference import extend_attention_reference
from gpu_worker.kernels.kv_store.kernel import store_kv
from gpu_worker.kernels.kv_store.reference import store_kv_reference
from gpu_worker.kernels.paged_decode.kernel import paged_decode
from gpu_worker.kernels.paged_decode.reference import paged_decode_reference
from gpu_worker.kernels.rmsnorm.kernel import fused_add_rms_norm
from gpu_worker.kernels.rmsnorm.reference import rms_norm_reference
from gpu_worker.kernels.rotary.kernel import rotary_embedding
from gpu_worker.kernels.rotary.reference import rotate_reference

Row = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class AttnShape:
    """Heads of one attention layer."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int


def tolerance(dtype: torch.dtype) -> float:
    """Max abs error allowed against the float32 reference (outputs are O(1))."""
    return 2e-3 if dtype == torch.float32 else 2e-2


def time_ms(fn: Callable[[], object], *, iters: int) -> float:
    """Median milliseconds per call: CUDA events on a GPU, the host clock elsewhere."""
    cuda = torch.cuda.is_available()
    for _ in range(3 if cuda else 0):  # compiles, autotunes, fills caches
        fn()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


@dataclasses.dataclass
class Paged:
    """A random paged cache and requests scattered through it."""

    kv_cache: torch.Tensor  # [2, num_blocks, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor  # [R, max_blocks] int32
    seq_lens: torch.Tensor  # [R] int32

    @property
    def kv_bytes_read(self) -> int:
        """K and V bytes that attention over every full context reads."""
        per_token = 2 * self.kv_cache.shape[3] * self.kv_cache.shape[4]
        return int(self.seq_lens.sum()) * per_token * self.kv_cache.element_size()


def make_paged(
    seq_lens: list[int], shape: AttnShape, block_size: int, dtype: torch.dtype, device: str
) -> Paged:
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 1
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)
    table = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32, device=device)
    start = 0
    for r, n in enumerate(blocks_per_seq):
        table[r, :n] = perm[start : start + n]
        start += n
    cache_shape = (2, num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
    return Paged(
        kv_cache=torch.randn(cache_shape, dtype=dtype, device=device),
        block_tables=table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
    )


def kv_cache_bytes(seq_lens: list[int], shape: AttnShape, block_size: int, itemsize: int) -> int:
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 1
    return 2 * num_blocks * block_size * shape.num_kv_heads * shape.head_dim * itemsize


def _err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.float() - ref.float()).abs().max().item()


def _row(kernel: str, shape: str, case: str, dtype: torch.dtype, err: float) -> Row:
    tol = tolerance(dtype)
    return {
        "kernel": kernel,
        "shape": shape,
        "case": case,
        "dtype": str(dtype).removeprefix("torch."),
        "max_abs_err": err,
        "tolerance": tol,
        "ok": err <= tol,
    }


def check_paged_decode(
    shape: AttnShape, seq_lens: list[int], block_size: int, dtype: torch.dtype, device: str
) -> Row:
    paged = make_paged(seq_lens, shape, block_size, dtype, device)
    q = torch.randn(len(seq_lens), shape.num_heads, shape.head_dim, dtype=dtype, device=device)
    scale = shape.head_dim**-0.5
    out = paged_decode(q, paged.kv_cache, paged.block_tables, paged.seq_lens, scale)
    ref = paged_decode_reference(q, paged.kv_cache, paged.block_tables, paged.seq_lens, scale)
    case = f"B={len(seq_lens)} ctx<={max(seq_lens)}"
    return _row("paged_decode", shape.name, case, dtype, _err(out, ref))


def check_extend(
    shape: AttnShape,
    requests: list[tuple[int, int]],  # (cached prefix, new tokens)
    block_size: int,
    dtype: torch.dtype,
    device: str,
) -> Row:
    seq_lens = [c + n for c, n in requests]
    paged = make_paged(seq_lens, shape, block_size, dtype, device)
    qsl = [0]
    for _, n in requests:
        qsl.append(qsl[-1] + n)
    q = torch.randn(qsl[-1], shape.num_heads, shape.head_dim, dtype=dtype, device=device)
    qsl_t = torch.tensor(qsl, dtype=torch.int32, device=device)
    scale = shape.head_dim**-0.5
    args = (q, paged.kv_cache, paged.block_tables, qsl_t, paged.seq_lens, scale)
    out = extend_attention(*args, max_query_len=max(n for _, n in requests))
    ref = extend_attention_reference(*args)
    case = "+".join(f"{c}:{n}" for c, n in requests)
    return _row("extend_attention", shape.name, f"prefix:new {case}", dtype, _err(out, ref))


def check_kv_store(
    shape: AttnShape, num_tokens: int, block_size: int, dtype: torch.dtype, device: str
) -> Row:
    num_slots = 2 * num_tokens
    cache = torch.zeros(
        2, num_slots // block_size + 1, block_size, shape.num_kv_heads, shape.head_dim,
        dtype=dtype, device=device,
    )  # fmt: skip
    k, v = (
        torch.randn(num_tokens, shape.num_kv_heads, shape.head_dim, dtype=dtype, device=device)
        for _ in range(2)
    )
    slots = torch.randperm(num_slots, device=device)[:num_tokens]
    slots[::7] = -1  # padding
    ref = cache.clone()
    store_kv(k, v, cache, slots)
    store_kv_reference(k, v, ref, slots)
    return _row("kv_store", shape.name, f"T={num_tokens}", dtype, _err(cache, ref))


def check_rms_norm(rows: int, hidden: int, dtype: torch.dtype, device: str) -> Row:
    x, residual = (torch.randn(rows, hidden, dtype=dtype, device=device) for _ in range(2))
    weight = torch.randn(hidden, dtype=dtype, device=device)
    out, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5)
    ref_out, ref_residual = rms_norm_reference(x, weight, 1e-5, residual)
    err = max(_err(out, ref_out), _err(new_residual, ref_residual))
    return _row("rmsnorm+residual", f"hidden {hidden}", f"rows={rows}", dtype, err)


def check_rotary(shape: AttnShape, num_tokens: int, dtype: torch.dtype, device: str) -> Row:
    half = shape.head_dim // 2
    inv_freq = 1.0 / 10000.0 ** (torch.arange(half, device=device) / half)
    angles = torch.arange(8192, device=device)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos(), angles.sin()
    q = torch.randn(num_tokens, shape.num_heads, shape.head_dim, dtype=dtype, device=device)
    k = torch.randn(num_tokens, shape.num_kv_heads, shape.head_dim, dtype=dtype, device=device)
    positions = torch.randint(0, 8192, (num_tokens,), device=device)
    ref_q, ref_k = (rotate_reference(x, positions, cos, sin) for x in (q, k))
    rotary_embedding(positions, q, k, cos, sin)
    err = max(_err(q, ref_q), _err(k, ref_k))
    return _row("rotary", shape.name, f"T={num_tokens}", dtype, err)


def copy_bandwidth(num_bytes: int, device: str, iters: int) -> float:
    """Device-to-device copy, bytes read + written per second."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), iters=iters)
    return 2 * num_bytes / (ms * 1e-3)


def decode_bandwidth(
    shape: AttnShape, batch: int, context: int, block_size: int, dtype: torch.dtype,
    device: str, iters: int, copy_bytes_per_s: float,
) -> Row:  # fmt: skip
    paged = make_paged([context] * batch, shape, block_size, dtype, device)
    q = torch.randn(batch, shape.num_heads, shape.head_dim, dtype=dtype, device=device)
    out = torch.empty_like(q)
    args = (q, paged.kv_cache, paged.block_tables, paged.seq_lens, shape.head_dim**-0.5)
    ms = time_ms(lambda: paged_decode(*args, out=out), iters=iters)
    achieved = paged.kv_bytes_read / (ms * 1e-3)
    return {
        "shape": shape.name,
        "batch": batch,
        "context": context,
        "dtype": str(dtype).removeprefix("torch."),
        "ms": ms,
        "kv_bytes": paged.kv_bytes_read,
        "achieved_GBps": achieved / 1e9,
        "copy_GBps": copy_bytes_per_s / 1e9,
        "fraction_of_copy": achieved / copy_bytes_per_s,
    }


def causal_flops(requests: list[tuple[int, int]], shape: AttnShape) -> float:
    """QK^T and PV over the visible (query, key) pairs: 4 * head_dim flops a pair per head."""
    pairs = sum(n * c + n * (n + 1) // 2 for c, n in requests)
    return 4.0 * shape.num_heads * shape.head_dim * pairs


def extend_speed(
    shape: AttnShape, batch: int, new_tokens: int, block_size: int, dtype: torch.dtype,
    device: str, iters: int,
) -> Row:  # fmt: skip
    """Our kernel on a paged cache vs SDPA on contiguous tensors: plain causal prefills."""
    requests = [(0, new_tokens)] * batch
    paged = make_paged([new_tokens] * batch, shape, block_size, dtype, device)
    total = batch * new_tokens
    q = torch.randn(total, shape.num_heads, shape.head_dim, dtype=dtype, device=device)
    qsl = torch.arange(0, total + 1, new_tokens, dtype=torch.int32, device=device)
    scale = shape.head_dim**-0.5
    out = torch.empty_like(q)
    args = (q, paged.kv_cache, paged.block_tables, qsl, paged.seq_lens, scale)
    ours_ms = time_ms(lambda: extend_attention(*args, max_query_len=new_tokens, out=out),
                      iters=iters)  # fmt: skip
    sq = q.view(batch, new_tokens, shape.num_heads, shape.head_dim).transpose(1, 2).contiguous()
    # SDPA's best case: contiguous K/V with the KV heads already expanded to every query
    # head, so its flash kernel runs whatever its GQA support
    q_per_kv = shape.num_heads // shape.num_kv_heads
    sk, sv = (
        torch.randn(
            batch, shape.num_kv_heads, new_tokens, shape.head_dim, dtype=dtype, device=device
        ).repeat_interleave(q_per_kv, dim=1)  # fmt: skip
        for _ in range(2)
    )

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(sq, sk, sv, is_causal=True, scale=scale)

    sdpa_ms = time_ms(sdpa, iters=iters)
    flops = causal_flops(requests, shape)
    return {
        "shape": shape.name,
        "batch": batch,
        "new_tokens": new_tokens,
        "dtype": str(dtype).removeprefix("torch."),
        "ours_ms": ours_ms,
        "sdpa_ms": sdpa_ms,
        "ours_TFLOPs": flops / (ours_ms * 1e-3) / 1e12,
        "sdpa_TFLOPs": flops / (sdpa_ms * 1e-3) / 1e12,
        "ours_over_sdpa": sdpa_ms / ours_ms,
    }
