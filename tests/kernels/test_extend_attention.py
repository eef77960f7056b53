"""Extend (prefill) attention over paged KV: kernel vs reference, reference vs a scalar loop."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from gpu_worker.kernels.extend_attention.kernel import extend_attention  # noqa: E402
from gpu_worker.kernels.extend_attention.reference import (  # noqa: E402
    extend_attention_reference,
)
from tests.kernels.paged import naive_paged_attention, paged_batch, randn  # noqa: E402

BLOCK_SIZE = 16
# (cached prefix, new tokens): a plain prefill of 1, prefills around block_size, a prefix
# ending mid-block, a prefix of exactly one block, and a chunk after a few hundred tokens
MIXED = [(0, 1), (0, BLOCK_SIZE - 1), (0, BLOCK_SIZE + 1), (5, 3), (BLOCK_SIZE, BLOCK_SIZE),
         (290, 20)]  # fmt: skip


def _run(requests, *, num_kv_heads, q_per_kv, head_dim, device, row_offset=0,
         dtype=torch.float32, window=0, softcap=0.0, q_gain=1.0, sinks=None,
         **blocks):  # fmt: skip
    """Returns (kernel output, reference) over the requests' rows."""
    seq_lens = [c + n for c, n in requests]
    query_lens = [n for _, n in requests]
    batch = paged_batch(seq_lens, block_size=BLOCK_SIZE, num_kv_heads=num_kv_heads,
                        head_dim=head_dim, device=device, dtype=dtype)  # fmt: skip
    qsl = [row_offset]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    q = randn(qsl[-1], num_kv_heads * q_per_kv, head_dim, seed=1, device=device) * q_gain
    q = q.to(dtype)
    qsl_t = torch.tensor(qsl, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    out = torch.full_like(q, 7.0)
    extend_attention(q, batch.kv_cache, batch.block_tables, qsl_t, batch.seq_lens, scale,
                     max_query_len=max(query_lens), out=out, window=window,
                     softcap=softcap, sinks=sinks, **blocks)  # fmt: skip
    ref = extend_attention_reference(q, batch.kv_cache, batch.block_tables, qsl_t,
                                     batch.seq_lens, scale, window, softcap, sinks)  # fmt: skip
    return out, ref


@pytest.mark.parametrize(
    "num_kv_heads, q_per_kv, head_dim",
    [(2, 1, 64), (1, 3, 64), (1, 8, 128)],
    ids=["mha-d64", "gqa3-d64", "gqa8-d128"],
)
def test_mixed_batch_matches_reference(num_kv_heads, q_per_kv, head_dim, device) -> None:
    out, ref = _run(MIXED, num_kv_heads=num_kv_heads, q_per_kv=q_per_kv, head_dim=head_dim,
                    device=device, block_m=16, block_n=16)  # fmt: skip
    assert (out - ref).abs().max().item() <= 2e-3


def test_default_tiles_and_rows_after_decodes(device) -> None:
    # the backend passes query_start_loc[num_decodes:], so rows start past 0; rows before
    # the first request (the decodes' rows) must be left as they were
    out, ref = _run([(17, 70), (0, 5)], num_kv_heads=2, q_per_kv=3, head_dim=128,
                    device=device, row_offset=3)  # fmt: skip
    assert (out[3:] - ref[3:]).abs().max().item() <= 2e-3
    assert bool((out[:3] == 7.0).all())


def test_half_precision(device) -> None:
    # fp16, not bf16: Triton's interpreter gets bf16 dots wrong (bf16 runs in gpu-check)
    out, ref = _run([(0, 20), (7, 9)], num_kv_heads=1, q_per_kv=2, head_dim=64,
                    device=device, dtype=torch.float16)  # fmt: skip
    assert out.dtype == torch.float16
    assert (out.float() - ref).abs().max().item() <= 1e-2


def test_reference_matches_naive_loop() -> None:
    requests = [(0, 3), (5, 2), (3, 1)]
    seq_lens = [c + n for c, n in requests]
    batch = paged_batch(seq_lens, block_size=4, num_kv_heads=1, head_dim=8)
    q = randn(6, 3, 8, seed=2)
    qsl = torch.tensor([0, 3, 5, 6], dtype=torch.int32)
    ref = extend_attention_reference(q, batch.kv_cache, batch.block_tables, qsl,
                                     batch.seq_lens, 0.3)  # fmt: skip
    naive = naive_paged_attention(q, batch, [n for _, n in requests], 0.3)
    assert (ref.double() - naive).abs().max().item() <= 1e-5


def test_launcher_rejects_bad_inputs(device) -> None:
    batch = paged_batch([4], block_size=4, num_kv_heads=2, head_dim=16, device=device)
    q = randn(4, 4, 16, seed=0, device=device)
    qsl = torch.tensor([0, 4], dtype=torch.int32, device=device)
    with pytest.raises(AssertionError, match="query_start_loc"):
        extend_attention(q, batch.kv_cache, batch.block_tables, qsl[:1], batch.seq_lens, 1.0,
                         max_query_len=4)  # fmt: skip
    with pytest.raises(AssertionError, match="cache"):
        extend_attention(q.double(), batch.kv_cache, batch.block_tables, qsl, batch.seq_lens,
                         1.0, max_query_len=4)  # fmt: skip


@pytest.mark.parametrize("window", [1, 7, 16, 40])
def test_sliding_window_matches_reference(window, device) -> None:
    # tiles of 16 rows and keys: later rows of a tile see nothing in its first key tiles
    out, ref = _run(MIXED, num_kv_heads=1, q_per_kv=3, head_dim=64, device=device,
                    window=window, block_m=16, block_n=16)  # fmt: skip
    assert not out.isnan().any()
    assert (out - ref).abs().max().item() <= 2e-3


def test_windowed_reference_matches_naive_loop() -> None:
    requests = [(0, 7), (5, 2), (3, 1)]
    seq_lens = [c + n for c, n in requests]
    batch = paged_batch(seq_lens, block_size=4, num_kv_heads=1, head_dim=8)
    q = randn(10, 3, 8, seed=2)
    qsl = torch.tensor([0, 7, 9, 10], dtype=torch.int32)
    ref = extend_attention_reference(q, batch.kv_cache, batch.block_tables, qsl,
                                     batch.seq_lens, 0.3, 3)  # fmt: skip
    naive = naive_paged_attention(q, batch, [n for _, n in requests], 0.3, window=3)
    assert (ref.double() - naive).abs().max().item() <= 1e-5


@pytest.mark.parametrize("window", [0, 7])
def test_soft_cap_matches_reference(window, device) -> None:
    out, ref = _run(MIXED, num_kv_heads=1, q_per_kv=3, head_dim=64, device=device,
                    window=window, softcap=3.0, q_gain=4.0, block_m=16, block_n=16)  # fmt: skip
    assert (out - ref).abs().max().item() <= 2e-3


@pytest.mark.parametrize("window", [0, 7])
def test_sinks_match_reference(window, device) -> None:
    sinks = torch.tensor([4.0, -2.0, 9.0], device=device)
    out, ref = _run(MIXED, num_kv_heads=1, q_per_kv=3, head_dim=64, device=device,
                    window=window, sinks=sinks, block_m=16, block_n=16)  # fmt: skip
    assert (out - ref).abs().max().item() <= 2e-3
