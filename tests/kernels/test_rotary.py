"""Neox rotary in place on q and k: kernel vs reference vs loop, and vs the model's rotate."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from gpu_worker.kernels.rotary.kernel import rotary_embedding  # noqa: E402
from gpu_worker.kernels.rotary.reference import rotate_reference  # noqa: E402
from gpu_worker.models.llama import RotaryEmbedding  # noqa: E402
from tests.kernels.paged import randn  # noqa: E402


def _tables(head_dim: int, device: torch.device) -> RotaryEmbedding:
    return RotaryEmbedding(head_dim, 512, 10000.0, None, torch.device(device))


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (8, 1, 128)])
def test_q_and_k_match_reference(num_heads, num_kv_heads, head_dim, device) -> None:
    rope = _tables(head_dim, device)
    num_tokens = 6
    # q and k as views of one fused qkv projection, as the model has them
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, seed=0, device=device)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
    k = k.view(num_tokens, num_kv_heads, head_dim)
    positions = torch.tensor([0, 1, 17, 300, 511, 2], device=device)
    expect_q = rotate_reference(q, positions, rope.cos, rope.sin)
    expect_k = rotate_reference(k, positions, rope.cos, rope.sin)
    v_before = qkv[:, (num_heads + num_kv_heads) * head_dim :].clone()
    rotary_embedding(positions, q, k, rope.cos, rope.sin)
    assert (q - expect_q).abs().max().item() <= 2e-3
    assert (k - expect_k).abs().max().item() <= 2e-3
    assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_dim :], v_before)


@pytest.mark.parametrize("head_dim, rotary_dim", [(16, 12), (128, 96), (96, 64)])
def test_partial_rotary_leaves_the_dims_past_rotary_dim(head_dim, rotary_dim, device) -> None:
    """Phi-4-mini's partial_rotary_factor 0.75 (and a 2/3): tables rotary_dim // 2 wide."""
    rope = _tables(rotary_dim, device)
    num_tokens, num_heads, num_kv_heads = 7, 6, 2
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, seed=3, device=device)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
    k = k.view(num_tokens, num_kv_heads, head_dim)
    positions = torch.tensor([0, 1, 17, 300, 511, 2, 64], device=device)
    expect_q = rotate_reference(q, positions, rope.cos, rope.sin)
    expect_k = rotate_reference(k, positions, rope.cos, rope.sin)
    model_q = rope.rotate(q.clone(), *rope(positions, q.dtype))
    q_pass, k_pass = q[..., rotary_dim:].clone(), k[..., rotary_dim:].clone()
    rotary_embedding(positions, q, k, rope.cos, rope.sin)
    assert (q - expect_q).abs().max().item() <= 2e-3
    assert (k - expect_k).abs().max().item() <= 2e-3
    assert (q - model_q).abs().max().item() <= 2e-3
    assert torch.equal(q[..., rotary_dim:], q_pass) and torch.equal(k[..., rotary_dim:], k_pass)


def test_matches_the_model_rotate(device) -> None:
    rope = _tables(64, device)
    x = randn(5, 2, 64, seed=1, device=device)
    positions = torch.tensor([3, 0, 44, 9, 100], device=device)
    expect = rope.rotate(x, *rope(positions, x.dtype))
    rotary_embedding(positions, x, None, rope.cos, rope.sin)
    assert (x - expect).abs().max().item() <= 1e-5


def test_reference_matches_loop() -> None:
    head_dim, theta = 8, 10000.0
    rope = RotaryEmbedding(head_dim, 16, theta, None, torch.device("cpu"))
    x = randn(2, 1, head_dim, seed=2)
    positions = torch.tensor([0, 5])
    out = rotate_reference(x, positions, rope.cos, rope.sin)
    half = head_dim // 2
    for t, pos in enumerate(positions.tolist()):
        row = x[t, 0].tolist()
        for i in range(half):
            angle = pos / theta ** (2 * i / head_dim)
            c, s = math.cos(angle), math.sin(angle)
            assert out[t, 0, i].item() == pytest.approx(row[i] * c - row[i + half] * s, abs=1e-5)
            assert out[t, 0, i + half].item() == pytest.approx(
                row[i + half] * c + row[i] * s, abs=1e-5
            )


def test_launcher_rejects_bad_inputs(device) -> None:
    rope = _tables(16, device)
    q = randn(2, 2, 16, seed=0, device=device)
    with pytest.raises(AssertionError, match="positions"):
        rotary_embedding(torch.tensor([0, 1], device=device).int(), q, None, rope.cos, rope.sin)
    with pytest.raises(AssertionError, match="sin_cache"):  # not as wide as cos_cache
        rotary_embedding(torch.tensor([0, 1], device=device), q, None, rope.cos[:, :4], rope.sin)
    with pytest.raises(AssertionError, match="rotary dims 32 of a 16-dim head"):
        wide = _tables(32, device)
        rotary_embedding(torch.tensor([0, 1], device=device), q, None, wide.cos, wide.sin)
