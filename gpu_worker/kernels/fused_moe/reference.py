"""The fused MoE in plain torch: the ground truth for `kernel` (float32 arithmetic)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fused_moe_reference(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2 * I, H]: gate rows then up rows
    w2: torch.Tensor,  # [E, H, I]
    weights: torch.Tensor,  # [T, k]
    ids: torch.Tensor,  # [T, k] int64
) -> torch.Tensor:  # [T, H] float32
    """sum over each token's slots (expert id order) of weight * down(silu(gate) * up)."""
    xf = x.float()
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    order = torch.argsort(ids, dim=1)
    for t in range(x.shape[0]):
        for j in order[t].tolist():
            e = int(ids[t, j])
            gate, up = F.linear(xf[t], w13[e].float()).chunk(2)
            h = F.silu(gate) * up
            out[t] += F.linear(h, w2[e].float()) * weights[t, j].float()
    return out
