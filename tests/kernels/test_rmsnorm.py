"""Fused residual-add + RMSNorm: kernel vs reference vs loop, and vs the model's RMSNorm."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from gpu_worker.kernels.rmsnorm.kernel import fused_add_rms_norm, rms_norm  # noqa: E402
from gpu_worker.kernels.rmsnorm.reference import rms_norm_reference  # noqa: E402
from gpu_worker.models.llama import RMSNorm  # noqa: E402
from tests.kernels.paged import randn  # noqa: E402


@pytest.mark.parametrize("hidden", [64, 576, 1000])
def test_matches_reference(hidden, device) -> None:
    x, residual = randn(5, hidden, seed=0, device=device), randn(5, hidden, seed=1, device=device)
    weight = randn(hidden, seed=2, device=device)
    out = rms_norm(x, weight, 1e-5)
    assert (out - rms_norm_reference(x, weight, 1e-5)[0]).abs().max().item() <= 2e-3
    out, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5)
    ref_out, ref_residual = rms_norm_reference(x, weight, 1e-5, residual)
    assert (out - ref_out).abs().max().item() <= 2e-3
    assert (new_residual - ref_residual).abs().max().item() <= 2e-3


def test_matches_the_model_norm_on_strided_rows(device) -> None:
    norm = RMSNorm(96, 1e-6).to(device)
    with torch.no_grad():
        norm.weight.copy_(randn(96, seed=3, device=device))
    x = randn(4, 200, seed=4, device=device)[:, 10:106]  # rows with a stride of 200
    assert (rms_norm(x, norm.weight, norm.eps) - norm(x)).abs().max().item() <= 1e-5


def test_reference_matches_loop() -> None:
    x, residual, weight = randn(2, 6, seed=0), randn(2, 6, seed=1), randn(6, seed=2)
    out, h = rms_norm_reference(x, weight, 1e-5, residual)
    for r in range(2):
        row = [a + b for a, b in zip(x[r].tolist(), residual[r].tolist(), strict=True)]
        rms = math.sqrt(sum(v * v for v in row) / len(row) + 1e-5)
        expect = [v / rms * w for v, w in zip(row, weight.tolist(), strict=True)]
        assert out[r].tolist() == pytest.approx(expect, abs=1e-5)
        assert h[r].tolist() == pytest.approx(row, abs=1e-6)


def test_launcher_rejects_bad_inputs(device) -> None:
    x = randn(3, 8, seed=0, device=device)
    with pytest.raises(AssertionError, match="weight"):
        rms_norm(x, randn(7, seed=1, device=device), 1e-5)
    with pytest.raises(AssertionError, match="residual"):
        fused_add_rms_norm(x, x.double(), randn(8, seed=1, device=device), 1e-5)
