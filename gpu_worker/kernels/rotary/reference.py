"""Neox-style rotary embedding in plain float32 torch: the ground truth for `kernel.rotary`."""

from __future__ import annotations

import torch


def rotate_reference(
    x: torch.Tensor,  # [T, heads, head_dim]
    positions: torch.Tensor,  # [T] int64
    cos_cache: torch.Tensor,  # [max_positions, rotary_dim // 2], rotary_dim <= head_dim
    sin_cache: torch.Tensor,  # [max_positions, rotary_dim // 2]
) -> torch.Tensor:  # [T, heads, head_dim] float32, a new tensor
    """x's first rotary_dim dims rotated pair by pair, (i, i + rotary_dim/2), by each token's
    position; the rest passed through."""
    half = cos_cache.shape[-1]
    cos = cos_cache[positions].float()[:, None, :]
    sin = sin_cache[positions].float()[:, None, :]
    xf = x.float()
    x1, x2, rest = xf[..., :half], xf[..., half : 2 * half], xf[..., 2 * half :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)
