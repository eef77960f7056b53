"""Paged decode attention: the Triton kernel against its torch reference, the reference
against a scalar loop. Small awkward shapes: under the interpreter each launch is slow."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from gpu_worker.kernels.paged_decode.kernel import paged_decode  # noqa: E402
from gpu_worker.kernels.paged_decode.reference import paged_decode_reference  # noqa: E402
from tests.kernels.paged import naive_paged_attention, paged_batch, randn  # noqa: E402

BLOCK_SIZE = 16
# context 1, block_size - 1, block_size, block_size + 1 and a few hundred, in one batch
MIXED_LENS = [1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 300]


def _check(seq_lens, *, num_kv_heads, q_per_kv, head_dim, num_splits, device, block_n=None,
           window=0, softcap=0.0, q_gain=1.0, sinks=None):  # fmt: skip
    batch = paged_batch(seq_lens, block_size=BLOCK_SIZE, num_kv_heads=num_kv_heads,
                        head_dim=head_dim, device=device)  # fmt: skip
    q = randn(len(seq_lens), num_kv_heads * q_per_kv, head_dim, seed=1, device=device) * q_gain
    scale = head_dim**-0.5
    out = paged_decode(q, batch.kv_cache, batch.block_tables, batch.seq_lens, scale,
                       window=window, softcap=softcap, sinks=sinks, num_splits=num_splits,
                       block_n=block_n)  # fmt: skip
    ref = paged_decode_reference(q, batch.kv_cache, batch.block_tables, batch.seq_lens, scale,
                                 window, softcap, sinks)  # fmt: skip
    assert (out - ref).abs().max().item() <= 2e-3


@pytest.mark.parametrize(
    "num_kv_heads, q_per_kv, head_dim",
    [(2, 1, 64), (1, 3, 64), (1, 8, 128), (2, 3, 128)],
    ids=["mha-d64", "gqa3-d64", "gqa8-d128", "gqa3-d128"],
)
def test_mixed_lengths_match_reference(num_kv_heads, q_per_kv, head_dim, device) -> None:
    _check(MIXED_LENS, num_kv_heads=num_kv_heads, q_per_kv=q_per_kv, head_dim=head_dim,
           num_splits=4, device=device)  # fmt: skip


@pytest.mark.parametrize("num_splits", [1, 16])
def test_split_counts_agree(num_splits, device) -> None:
    # 16 splits over short contexts leaves most splits empty; 1 split is plain flash decoding
    _check([3, 40, 129], num_kv_heads=1, q_per_kv=3, head_dim=64, num_splits=num_splits,
           device=device, block_n=16)  # fmt: skip


def test_many_query_heads_per_kv_head(device) -> None:
    # 80 query heads on one KV head: more than one 64-row head tile per group
    _check([5, 33], num_kv_heads=1, q_per_kv=80, head_dim=64, num_splits=2, device=device)


def test_reference_matches_naive_loop() -> None:
    seq_lens = [1, 5, 9]
    batch = paged_batch(seq_lens, block_size=4, num_kv_heads=2, head_dim=8)
    q = randn(3, 6, 8, seed=2)
    ref = paged_decode_reference(q, batch.kv_cache, batch.block_tables, batch.seq_lens, 0.3)
    naive = naive_paged_attention(q, batch, [1, 1, 1], 0.3)
    assert (ref.double() - naive).abs().max().item() <= 1e-5


def test_launcher_rejects_bad_inputs(device) -> None:
    batch = paged_batch([4], block_size=4, num_kv_heads=2, head_dim=16, device=device)
    q = randn(1, 4, 16, seed=0, device=device)
    with pytest.raises(AssertionError, match="seq_lens"):
        paged_decode(q, batch.kv_cache, batch.block_tables, batch.seq_lens.long(), 1.0)
    with pytest.raises(AssertionError, match="heads"):
        paged_decode(q[:, :3], batch.kv_cache, batch.block_tables, batch.seq_lens, 1.0)
    with pytest.raises(AssertionError, match="contiguous"):
        strided = randn(1, 4, 32, seed=0, device=device)[..., ::2]
        paged_decode(strided, batch.kv_cache, batch.block_tables, batch.seq_lens, 1.0)


def test_half_precision(device) -> None:
    # fp16, not bf16: Triton's interpreter gets bf16 dots wrong (bf16 runs in gpu-check)
    batch = paged_batch([1, 17, 300], block_size=BLOCK_SIZE, num_kv_heads=2, head_dim=64,
                        device=device, dtype=torch.float16)  # fmt: skip
    q = randn(3, 6, 64, seed=1, device=device).half()
    out = paged_decode(q, batch.kv_cache, batch.block_tables, batch.seq_lens, 0.125)
    ref = paged_decode_reference(q, batch.kv_cache, batch.block_tables, batch.seq_lens, 0.125)
    assert out.dtype == torch.float16
    assert (out.float() - ref).abs().max().item() <= 1e-2


@pytest.mark.parametrize("window", [1, 15, 16, 40])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_sliding_window_matches_reference(window, num_splits, device) -> None:
    # contexts shorter than, equal to and many times the window; the splits share out only
    # the window's positions
    _check(MIXED_LENS, num_kv_heads=1, q_per_kv=3, head_dim=64, num_splits=num_splits,
           device=device, block_n=16, window=window)  # fmt: skip


def test_windowed_reference_matches_naive_loop() -> None:
    seq_lens = [1, 5, 9]
    batch = paged_batch(seq_lens, block_size=4, num_kv_heads=2, head_dim=8)
    q = randn(3, 6, 8, seed=2)
    ref = paged_decode_reference(q, batch.kv_cache, batch.block_tables, batch.seq_lens, 0.3, 3)
    naive = naive_paged_attention(q, batch, [1, 1, 1], 0.3, window=3)
    assert (ref.double() - naive).abs().max().item() <= 1e-5


@pytest.mark.parametrize("window", [0, 16])
def test_soft_cap_matches_reference(window, device) -> None:
    # q scaled up so that most scores are past the cap's knee
    _check(MIXED_LENS, num_kv_heads=2, q_per_kv=3, head_dim=64, num_splits=4, device=device,
           block_n=16, window=window, softcap=3.0, q_gain=4.0)  # fmt: skip


@pytest.mark.parametrize("window", [0, 16])
def test_sinks_match_reference(window, device) -> None:
    # one sink large enough to take most of its head's weight, one negligible
    sinks = torch.tensor([4.0, -2.0, 0.5, 9.0, -30.0, 1.0], device=device)
    _check(MIXED_LENS, num_kv_heads=2, q_per_kv=3, head_dim=64, num_splits=4, device=device,
           block_n=16, window=window, sinks=sinks)  # fmt: skip
