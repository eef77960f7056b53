"""RMSNorm (+ residual add) in plain float32 torch: the ground truth for `kernel.rms_norm`."""

from __future__ import annotations

import torch


def rms_norm_reference(
    x: torch.Tensor,  # [rows, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [rows, hidden], added to x first
) -> tuple[torch.Tensor, torch.Tensor]:  # (out, x + residual) both float32
    """The normalised rows and the (new) residual stream, in float32."""
    h = x.float() if residual is None else x.float() + residual.float()
    out = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()
    return out, h
