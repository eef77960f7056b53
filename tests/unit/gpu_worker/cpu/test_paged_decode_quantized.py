"""Attention over a quantized KV cache (--kv-cache-dtype int8 / fp8_e4m3 / fp8_e5m2): the C
decode kernel and the torch backend's paths read the stored rows directly; each is checked
against the naive loop over the same rows read back in float32 (gpu_worker/kv_quant.py)."""

from __future__ import annotations

import random

import pytest
import torch

from gpu_worker.attention import build_metadata, create_backend
from gpu_worker.cpu import paged_decode
from gpu_worker.kv_cache import KVCache, bytes_per_block
from gpu_worker.kv_quant import KVFormat, resolve_kv_cache_dtype
from tests.unit.gpu_worker.attention.test_torch_backend import naive_attention

torch.set_num_threads(2)

FORMATS = ["int8", "fp8_e4m3", "fp8_e5m2"]
needs_kernel = pytest.mark.skipif(paged_decode.load() is None, reason="no C compiler here")


def _case(contexts, *, block_size, num_kv_heads, q_per_kv, head_dim, fmt, seed=0):  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_blocks = sum(-(-c // block_size) for c in contexts) + 8
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-c // block_size))] for c in contexts]
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    cache[0, :, :, 0] *= 8  # rows of different magnitudes: per-row scales differ
    stored = fmt.quantize(cache)
    q = torch.randn(len(contexts), num_kv_heads * q_per_kv, head_dim, generator=gen)
    return q, stored, fmt.dequantize(stored, torch.float32), tables


def test_names_and_rows() -> None:
    assert resolve_kv_cache_dtype("fp8") == "fp8_e4m3"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        resolve_kv_cache_dtype("q4_0")
    with pytest.raises(ValueError, match="head_dim"):
        KVFormat.create("int8", torch.float32).row_width(6)
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 2, 50)[:, None, None]
    x[7, 1] = 0.0  # an all-zero row: scale 1, values 0
    # int8: half a step of max|row| / 127; fp8: half a mantissa step, or half the smallest
    # subnormal (2^-9 for e4m3, 2^-16 for e5m2) near zero
    for name, rel, tiny in (("int8", 1 / 254, 0), ("fp8_e4m3", 1 / 16, 2.0**-10),
                            ("fp8_e5m2", 1 / 8, 2.0**-17)):  # fmt: skip
        fmt = KVFormat.create(name, torch.float32)
        rows = fmt.quantize(x)
        assert rows.dtype == fmt.storage_dtype and rows.shape[-1] == fmt.row_width(64)
        back = fmt.dequantize(rows)
        amax = x.abs().amax(-1, keepdim=True)
        bound = amax * rel if name == "int8" else x.abs() * rel + tiny
        assert ((back - x).abs() <= bound * 1.0001 + 1e-12).all(), name
        assert back[7, 1].eq(0).all()
        # a row's bytes depend on that row alone
        assert torch.equal(fmt.quantize(x[3:4]), rows[3:4])


def test_blocks_per_gib_grow() -> None:
    layout = dict(num_layers=4, block_size=16, num_kv_heads=2, head_dim=64)
    f32 = bytes_per_block(**layout, dtype=torch.float32)
    assert (
        bytes_per_block(**layout, dtype=torch.float32, kv_cache_dtype="int8") * 4 == f32 * 68 // 64
    )
    assert bytes_per_block(**layout, dtype=torch.float32, kv_cache_dtype="fp8") * 4 == f32
    cache = KVCache(num_blocks=3, dtype=torch.bfloat16, device=torch.device("cpu"),
                    kv_cache_dtype="int8", **layout)  # fmt: skip
    assert cache.tensor.dtype == torch.int8 and cache.tensor.shape[-1] == 68
    assert cache.num_bytes == 3 * bytes_per_block(**layout, dtype=torch.bfloat16,
                                                  kv_cache_dtype="int8")  # fmt: skip


@needs_kernel
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("num_seqs", [3, 40])  # one KV head per task, or whole sequences
def test_kernel_reads_quantized_rows(name: str, head_dim: int, num_seqs: int) -> None:
    fmt = KVFormat.create(name, torch.float32)
    contexts = [1 + (37 * i) % 150 for i in range(num_seqs)]
    q, stored, ref_cache, tables = _case(
        contexts, block_size=16, num_kv_heads=2, q_per_kv=3, head_dim=head_dim, fmt=fmt
    )
    meta = build_metadata([c - 1 for c in contexts], [1] * num_seqs, tables, 16)
    prior = [c - 1 for c in contexts]
    scale = head_dim**-0.5
    out = paged_decode.paged_decode(
        q, stored, meta.block_tables, meta.seq_lens, scale, kv_format=fmt
    )
    ref = naive_attention(q, ref_cache, prior, [1] * num_seqs, tables)
    assert out is not None
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("name", FORMATS)
def test_kernel_quantized_with_window_softcap_and_sinks(name: str) -> None:
    fmt = KVFormat.create(name, torch.float32)
    contexts = [1, 16, 40, 150]
    q, stored, ref_cache, tables = _case(
        contexts, block_size=16, num_kv_heads=2, q_per_kv=3, head_dim=64, fmt=fmt
    )
    q = q * 4
    sinks = torch.tensor([2.0, -3.0, 0.0, 6.0, 1.5, -0.5])
    meta = build_metadata([c - 1 for c in contexts], [1] * 4, tables, 16)
    out = paged_decode.paged_decode(
        q, stored, meta.block_tables, meta.seq_lens, 0.3, 9, 5.0, sinks, kv_format=fmt
    )
    prior = [c - 1 for c in contexts]
    ref = naive_attention(q, ref_cache, prior, [1] * 4, tables, 9, 0.3, 5.0, sinks)
    assert out is not None
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def _backend(name: str, **extra):
    return create_backend(
        "torch", num_heads=6, num_kv_heads=2, head_dim=64, dtype=torch.float32,
        device=torch.device("cpu"), kv_cache_dtype=name, **extra,
    )  # fmt: skip


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("variant", ["eager", "kernel", "batch_invariant"])
@pytest.mark.parametrize("extras", ["plain", "window_softcap_sinks"])
def test_backend_stores_quantized_and_attends(name: str, variant: str, extras: str) -> None:
    """A mixed step (decodes, a first chunk, a later chunk) stores its K/V quantized and
    attends over the rows as stored, on every path of the torch backend."""
    if variant != "eager" and paged_decode.load() is None:
        pytest.skip("no C compiler here")
    fmt = KVFormat.create(name, torch.float32)
    backend = _backend(
        name,
        cpu_decode_kernel=variant != "eager",
        batch_invariant=variant == "batch_invariant",
        **({"softcap": 5.0} if extras != "plain" else {}),
    )
    window = 9 if extras != "plain" else 0
    sinks = torch.tensor([2.0, -3.0, 0.0, 6.0, 1.5, -0.5]) if extras != "plain" else None
    num_computed, num_new = [20, 33, 0, 17], [1, 1, 12, 9]
    contexts = [c + n for c, n in zip(num_computed, num_new, strict=True)]
    _, stored, _, tables = _case(
        contexts, block_size=8, num_kv_heads=2, q_per_kv=3, head_dim=64, fmt=fmt, seed=3
    )
    gen = torch.Generator().manual_seed(4)
    t = sum(num_new)
    q = torch.randn(t, 6, 64, generator=gen) * 3
    k, v = torch.randn(t, 2, 64, generator=gen), torch.randn(t, 2, 64, generator=gen)
    meta = build_metadata(num_computed, num_new, tables, 8)
    out = backend.forward(q, k, v, stored, backend.build_metadata(meta), window, sinks)
    # the new rows stored as quantize() stores them, each independently
    flat_k = stored[0].view(-1, 2, stored.shape[-1])
    assert torch.equal(flat_k[meta.slot_mapping], fmt.quantize(k))
    ref = naive_attention(
        q, fmt.dequantize(stored, torch.float32), num_computed, num_new, tables, window,
        None, 5.0 if extras != "plain" else 0.0, sinks,
    )  # fmt: skip
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)


@needs_kernel
@pytest.mark.parametrize("name", FORMATS)
def test_batch_invariant_rows_same_bits_however_chunked(name: str) -> None:
    """A prompt attended in one chunk, in two, or token by token: the same bits."""
    gen = torch.Generator().manual_seed(5)
    n = 21
    q = torch.randn(n, 6, 64, generator=gen)
    k, v = torch.randn(n, 2, 64, generator=gen), torch.randn(n, 2, 64, generator=gen)
    results = []
    for cuts in ([0, n], [0, 8, n], list(range(n + 1))):
        backend = _backend(name, batch_invariant=True)
        cache = KVCache(num_layers=1, num_blocks=4, block_size=8, num_kv_heads=2, head_dim=64,
                        dtype=torch.float32, device=torch.device("cpu"),
                        kv_cache_dtype=name).layer(0)  # fmt: skip
        outs = []
        for a, b in zip(cuts, cuts[1:], strict=False):
            meta = build_metadata([a], [b - a], [[2, 0, 3]], 8)
            outs.append(
                backend.forward(q[a:b], k[a:b], v[a:b], cache, backend.build_metadata(meta))
            )
        results.append(torch.cat(outs))
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


@needs_kernel
@pytest.mark.parametrize("name", FORMATS)
def test_c_store_writes_the_bits_torch_writes(name: str) -> None:
    """The one-call step's C store (paged_decode.c's store_row) against KVFormat.quantize."""
    import ctypes

    from gpu_worker.cpu import one_call_step

    lib = one_call_step.load()
    if lib is None:
        pytest.skip("no C compiler here")
    lib.shuttle_test_store_row.restype = None
    lib.shuttle_test_store_row.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                           ctypes.c_int, ctypes.c_int]  # fmt: skip
    fmt = KVFormat.create(name, torch.float32)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(400, 64, generator=gen) * torch.logspace(-7, 3, 400)[:, None]
    x[0, :4] = torch.tensor([0.5 * 2**-9, 1.5 * 2**-9, 1000.0, -70000.0])  # ties, clamps
    x[1] = 0.0
    x[2, :8] = torch.tensor([0.5, 1.5, 2.5, -0.5, 3.5, 126.5, -126.5, 2**-17])  # int8 ties
    want = fmt.quantize(x)
    got = torch.empty_like(want)
    lib.shuttle_test_store_row(got.data_ptr(), fmt.kind, x.data_ptr(), 64, 400)
    assert torch.equal(got, want)


@needs_kernel
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("head_dim", [32, 64, 128])  # attend() and attend_fixed's instances
def test_kernel_reads_every_code_as_torch_does(name: str, head_dim: int) -> None:
    """A one-token sequence's output is its V row (p = 1): every fp8 code (NaN and the
    infinities included) and int8 rows of any scale read back exactly as dequantize reads
    them."""
    fmt = KVFormat.create(name, torch.float32)
    rows = 512 // head_dim  # every one of the 256 codes, twice over
    if name == "int8":
        gen = torch.Generator().manual_seed(7)
        v = (
            torch.randn(rows, 1, head_dim, generator=gen)
            * torch.logspace(-6, 4, rows)[:, None, None]
        )
        v_rows = fmt.quantize(v)
    else:
        codes = torch.arange(512, dtype=torch.int32) % 256
        v_rows = codes.to(torch.uint8).view(rows, 1, head_dim)
    k_rows = fmt.quantize(torch.zeros(rows, 1, head_dim))  # finite scores
    cache = torch.stack((k_rows, v_rows))[:, :, None]  # [2, rows (blocks), 1, 1, row]
    q = torch.randn(rows, 1, head_dim)
    tables = torch.arange(rows, dtype=torch.int32)[:, None]
    lens = torch.ones(rows, dtype=torch.int32)
    out = paged_decode.paged_decode(q, cache, tables, lens, 0.125, kv_format=fmt)
    assert out is not None
    want = fmt.dequantize(v_rows, torch.float32)
    assert torch.equal(out.isnan(), want.isnan())
    assert torch.equal(out.nan_to_num(), want.nan_to_num())


@needs_kernel
@pytest.mark.parametrize("name", ["auto", *FORMATS])
@pytest.mark.parametrize("head_dim", [64, 128, 96])
def test_kernel_token_same_bits_in_any_batch(name: str, head_dim: int) -> None:
    """A sequence's output alone, in a batch of 40 (whole sequences per task) or of 3 (one
    KV head per task), on 1 or 2 threads: the same bits."""
    fmt = KVFormat.create(name, torch.float32)
    contexts = [1 + (53 * i) % 200 for i in range(40)]
    q, stored, _, tables = _case(
        contexts, block_size=16, num_kv_heads=2, q_per_kv=3, head_dim=head_dim, fmt=fmt
    )
    meta = build_metadata([c - 1 for c in contexts], [1] * 40, tables, 16)

    def run(rows: slice) -> torch.Tensor:
        out = paged_decode.paged_decode(
            q[rows], stored, meta.block_tables[rows], meta.seq_lens[rows], 0.1, kv_format=fmt
        )
        assert out is not None
        return out

    whole = run(slice(0, 40))
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for i in (0, 7, 39):
                assert torch.equal(run(slice(i, i + 1)), whole[i : i + 1]), (t, i)
            assert torch.equal(run(slice(5, 8)), whole[5:8]), t
    finally:
        torch.set_num_threads(threads)
