"""Neox-style rotary embedding in plain float32 torch: the ground truth for `kernel.rotary`."""

from __future__ import annotations

import torch


def rotate_reference(
    x: torch.Tensor,  # [T, heads, head_dim]
    positions: torch.Tensor,  # [T] int64
    cos_cache: torch.Tensor,  # [max_positions, head_dim // 2]
    sin_cache: torch.Tensor,  # [max_positions, head_dim // 2]
) -> torch.Tensor:  # [T, heads, head_dim] float32, a new tensor
    """x rotated pair by pair, (i, i + d/2), by each token's position."""
    cos = cos_cache[positions].float()[:, None, :]
    sin = sin_cache[positions].float()[:, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
