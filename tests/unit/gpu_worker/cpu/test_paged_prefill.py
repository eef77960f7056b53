"""The blocked prefill kernel (paged_decode.py's paged_prefill) against the row-by-row path
it replaces in batch-invariant mode: every query row's output must be the same bits as the
decode kernel gives that row as a decode of its own length (torch.equal), for every KV row
format, head size, GQA ratio, chunk length, cached prefix, block size, window, soft cap,
sinks and thread count. The decode kernel is itself checked against a naive reference
(test_paged_decode.py, test_paged_decode_quantized.py); one case here checks the same."""

from __future__ import annotations

import platform
import random

import pytest
import torch

from common.cpu_features import cpu_flags
from gpu_worker.cpu import paged_decode
from gpu_worker.kv_quant import KVFormat
from tests.unit.gpu_worker.attention.test_torch_backend import naive_attention

pytestmark = pytest.mark.skipif(paged_decode.load() is None, reason="no C compiler here")

# (KV format name, model dtype): float32 and bfloat16 rows, int8, both fp8s
FORMATS = [
    ("auto", torch.float32),
    ("auto", torch.bfloat16),
    ("int8", torch.float32),
    ("fp8_e4m3", torch.float32),
    ("fp8_e5m2", torch.float32),
]
CHUNKS = [1, 3, 17, 64]
# this CPU's build, and an AVX2-only one (-march=haswell: what an AVX2 server compiles)
MARCHES = ["native"]
if platform.machine() == "x86_64" and "avx2" in cpu_flags():
    MARCHES.append("haswell")


def _cache(
    context: int,
    *,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    fmt: KVFormat,
    dtype: torch.dtype,
    seed: int,
):
    """A stored cache with one sequence of `context` positions on shuffled blocks, and its
    block table."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = -(-context // block_size) + 3
    blocks = list(range(num_blocks))
    random.Random(seed).shuffle(blocks)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    cache[0, :, :, 0] *= 8  # rows of different magnitudes: per-row scales differ
    table = torch.tensor(blocks[: -(-context // block_size)], dtype=torch.int32)
    return fmt.quantize(cache.to(dtype)), table


def _by_rows(q, cache, table, first, fmt, march, scale, window=0, softcap=0.0, sinks=None):
    """The row-by-row path (the torch backend's _extend_by_rows before the blocked kernel)."""
    n = q.shape[0]
    lens = torch.arange(first + 1, first + n + 1, dtype=torch.int32)
    out = paged_decode.paged_decode(
        q, cache, table[None].expand(n, -1), lens, scale, window, softcap, sinks, fmt, march
    )
    assert out is not None
    return out


def _check_same_bits(
    fmt_name,
    dtype,
    *,
    march="native",
    head_dim,
    q_per_kv,
    block_size,
    chunks,
    prefixes,
    window=0,
    softcap=0.0,
    with_sinks=False,
    seed=0,
):
    fmt = KVFormat.create(fmt_name, dtype)
    num_kv_heads = 2
    num_heads = num_kv_heads * q_per_kv
    gen = torch.Generator().manual_seed(seed + 1)
    sinks = torch.randn(num_heads, generator=gen) * 3 if with_sinks else None
    for first in prefixes:
        for n in chunks:
            cache, table = _cache(
                first + n,
                block_size=block_size,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                fmt=fmt,
                dtype=dtype,
                seed=seed + n,
            )
            q = (torch.randn(n, num_heads, head_dim, generator=gen) * 2).to(dtype)
            want = _by_rows(q, cache, table, first, fmt, march, 0.125, window, softcap, sinks)
            for threads in (1, 2):
                torch.set_num_threads(threads)
                got = paged_decode.paged_prefill(
                    q, cache, table, first, 0.125, window, softcap, sinks, fmt, march
                )
                assert got is not None
                assert got.dtype == want.dtype
                assert torch.equal(got, want), (first, n, threads)


@pytest.fixture(autouse=True)
def _restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize(("fmt_name", "dtype"), FORMATS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("q_per_kv", [1, 3])
def test_rows_same_bits_as_the_row_kernel(march, fmt_name, dtype, head_dim, q_per_kv) -> None:
    """Chunks of 1, 3, 17, 64 tokens with no cached prefix and after 37 or 300 cached
    positions (300: enough work that 2 threads run), block sizes 16 and 32."""
    for block_size in (16, 32):
        _check_same_bits(
            fmt_name,
            dtype,
            march=march,
            head_dim=head_dim,
            q_per_kv=q_per_kv,
            block_size=block_size,
            chunks=CHUNKS,
            prefixes=(0, 37, 300),
        )


@pytest.mark.parametrize(("fmt_name", "dtype"), FORMATS)
@pytest.mark.parametrize(
    ("window", "softcap", "with_sinks"),
    [(9, 0.0, False), (40, 5.0, False), (0, 5.0, True), (24, 0.0, True)],
)
def test_window_softcap_and_sinks_same_bits(fmt_name, dtype, window, softcap, with_sinks) -> None:
    """Sliding windows narrower and wider than a block (rows whose first visible position
    differs inside one tile), Gemma 2's soft cap, gpt-oss's sinks."""
    _check_same_bits(
        fmt_name,
        dtype,
        head_dim=64,
        q_per_kv=3,
        block_size=16,
        chunks=(17, 64),
        prefixes=(0, 45),
        window=window,
        softcap=softcap,
        with_sinks=with_sinks,
    )


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("fmt_name", ["auto", "int8"])
def test_matches_naive_attention(march: str, fmt_name: str) -> None:
    """A chunk after a cached prefix, against the plain torch reference, on every build (the
    AVX2 one sums its scores on 8 lanes, the AVX-512 one on 16)."""
    fmt = KVFormat.create(fmt_name, torch.float32)
    first, n = 21, 19
    cache, table = _cache(
        first + n, block_size=16, num_kv_heads=2, head_dim=64, fmt=fmt, dtype=torch.float32, seed=3
    )
    q = torch.randn(n, 6, 64, generator=torch.Generator().manual_seed(4))
    sinks = torch.tensor([2.0, -3.0, 0.0, 6.0, 1.5, -0.5])
    got = paged_decode.paged_prefill(
        q, cache, table, first, 0.3, 9, 5.0, sinks, kv_format=fmt, march=march
    )
    ref = naive_attention(
        q, fmt.dequantize(cache, torch.float32), [first], [n], [table.tolist()], 9, 0.3, 5.0, sinks
    )
    assert got is not None
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_other_head_sizes_left_to_the_row_path() -> None:
    fmt = KVFormat.create("auto", torch.float32)
    cache, table = _cache(
        10, block_size=16, num_kv_heads=2, head_dim=96, fmt=fmt, dtype=torch.float32, seed=0
    )
    q = torch.randn(4, 4, 96)
    assert paged_decode.paged_prefill(q, cache, table, 6, 0.1, kv_format=fmt) is None
