"""W8A8 int8 matmul: per-row quantization and the int8 GEMM against their torch references.

The int8 dot products are exact (int32 in the kernel, float64 in the reference), so in
float32 the two differ only by the rounding of two products: 1e-6 relative. With fp16/bf16
activations only the output's rounding to x's dtype differs (half an ulp, so 2u relative)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from gpu_worker.kernels.int8_matmul.kernel import int8_matmul, int8_tiles, quantize_rows  # noqa: E402
from gpu_worker.kernels.int8_matmul.reference import (  # noqa: E402
    int8_matmul_reference,
    quantize_rows_reference,
)

RELATIVE = {torch.float32: 1e-6, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_rows_reference(randn(n, k, seed=seed))


def test_quantize_rows_matches_reference_and_loop(device) -> None:
    x = randn(5, 200, seed=0) * torch.tensor([1.0, 0.0, 1e-3, 50.0, 1.0])[:, None]
    x[4, :3] = torch.tensor([127.0, 1.5, -2.5])  # scale 1: ties round away from zero
    q, scale = quantize_rows(x.to(device))
    ref_q, ref_scale = quantize_rows_reference(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    assert torch.equal(q.cpu(), ref_q) and torch.equal(scale.cpu(), ref_scale)
    assert ref_scale[1] == 0 and (ref_q[1] == 0).all()
    assert ref_scale[4] == 1.0 and ref_q[4, :3].tolist() == [127, 2, -3]
    for r in (0, 3):
        amax = max(abs(v) for v in x[r].tolist())
        assert ref_scale[r].item() == pytest.approx(amax / 127, rel=1e-6)
        assert ref_q[r].abs().max().item() == 127
    assert (ref_q.float() * ref_scale[:, None] - x).abs().max() <= ref_scale.max() / 2 * 1.0001


def test_quantize_rows_loops_over_long_rows(device) -> None:
    x = randn(2, 5000, seed=1)  # longer than MAX_QUANT_BLOCK: the peak is in the second chunk
    x[1, 4500] = 40.0
    q, scale = quantize_rows(x.to(device))
    ref_q, ref_scale = quantize_rows_reference(x)
    assert torch.equal(q.cpu(), ref_q) and torch.equal(scale.cpu(), ref_scale)


@pytest.mark.parametrize("m", [1, 3, 17, 70])
def test_matches_reference_fp32(m: int, device) -> None:
    n, k = 96, 160  # a partial BLOCK_N tile; K no multiple of BLOCK_K
    w, w_scale = weight(n, k, seed=m)
    x = randn(m, k, seed=100 + m)
    out = int8_matmul(x.to(device), w.to(device), w_scale.to(device))
    ref = int8_matmul_reference(x, w, w_scale)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    assert ((out.cpu() - ref).abs() <= RELATIVE[torch.float32] * ref.abs() + 1e-6).all()
    # and what it approximates: the float matmul, within int8 quantization's error
    exact = x @ (w.float() * w_scale[:, None]).t()
    assert (out.cpu() - exact).abs().max().item() <= 0.05 * exact.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_matches_reference_half(dtype: torch.dtype, device) -> None:
    w, w_scale = weight(64, 128, seed=5)
    x = randn(3, 128, seed=6).to(dtype)
    out = int8_matmul(x.to(device), w.to(device), w_scale.to(device))
    ref = int8_matmul_reference(x, w, w_scale)
    assert out.dtype == dtype
    assert ((out.cpu().float() - ref).abs() <= RELATIVE[dtype] * ref.abs()).all()


def test_rows_do_not_depend_on_the_batch(device) -> None:
    w, w_scale = weight(64, 96, seed=8)
    w, w_scale = w.to(device), w_scale.to(device)
    x = randn(20, 96, seed=9).to(device)
    assert int8_tiles(1)[0] != int8_tiles(20)[0]  # other tiles, same per-row result
    alone = int8_matmul(x[4:5], w, w_scale)
    assert torch.equal(int8_matmul(x, w, w_scale)[4:5], alone)


def test_split_k_is_bit_identical(device) -> None:
    w, w_scale = weight(80, 512, seed=12)  # 4 K steps of 128
    w, w_scale = w.to(device), w_scale.to(device)
    x = randn(5, 512, seed=13).to(device)
    whole = int8_matmul(x, w, w_scale, split_k=1)
    assert torch.equal(int8_matmul(x, w, w_scale, split_k=2), whole)
    assert torch.equal(int8_matmul(x, w, w_scale, split_k=3), whole)  # ranges of 2+2 steps
    assert torch.equal(int8_matmul(x, w, w_scale, split_k=4), whole)


def test_empty_shapes(device) -> None:
    w = torch.zeros(8, 0, dtype=torch.int8, device=device)
    out = int8_matmul(torch.ones(2, 0, device=device), w, torch.ones(8, device=device))
    assert out.shape == (2, 8) and (out == 0).all()
    w, w_scale = (t.to(device) for t in weight(8, 4, seed=0))
    assert int8_matmul(torch.ones(0, 4, device=device), w, w_scale).shape == (0, 8)


def test_launcher_rejects_bad_inputs(device) -> None:
    w, w_scale = weight(32, 64, seed=0)
    w, w_scale = w.to(device), w_scale.to(device)
    x = randn(2, 64, seed=1).to(device)
    with pytest.raises(AssertionError, match="weight must be int8"):
        int8_matmul(x, w.float(), w_scale)
    with pytest.raises(AssertionError, match="weight must be int8"):
        int8_matmul(x[:, :32], w, w_scale)
    with pytest.raises(AssertionError, match="weight_scale"):
        int8_matmul(x, w, w_scale[:16])
    with pytest.raises(AssertionError, match="weight_scale"):
        int8_matmul(x, w, w_scale.double())
