"""Per-row int8 quantization and the W8A8 matmul in torch: the ground truth for `kernel`."""

from __future__ import annotations

import torch

QMAX = 127.0


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] float -> (int8 [R, C], float32 scale [R]) with x ~ q * scale[:, None].

    Symmetric, round half away from zero (ggml's roundf); an all-zero row has scale 0.
    Also how a float weight [out, in] becomes int8 with per-output-channel scales."""
    xf = x.float()
    scale = xf.abs().amax(dim=1) / QMAX
    v = torch.where(scale[:, None] > 0, xf / scale[:, None], torch.zeros_like(xf))
    q = (torch.sign(v) * torch.floor(v.abs() + 0.5)).clamp(-QMAX, QMAX)
    return q.to(torch.int8), scale


def int8_matmul_reference(
    x: torch.Tensor,  # [M, K] float
    weight: torch.Tensor,  # [N, K] int8
    weight_scale: torch.Tensor,  # [N] float32
) -> torch.Tensor:  # [M, N] float32
    """(quantize_rows(x) @ weight^T) * x_scale * weight_scale; the dots exact (float64)."""
    q, scale = quantize_rows_reference(x)
    dots = (q.double() @ weight.double().t()).float()
    return dots * scale[:, None] * weight_scale.float()[None, :]
