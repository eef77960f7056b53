"""The LoRA delta in torch: the ground truth for `kernel` (the contract's own reference,
gpu_worker/lora/layer.py's lora_delta_reference, which imports no triton)."""

from __future__ import annotations

import torch

from gpu_worker.lora.layer import lora_delta_reference


def lora_add_reference(
    y: torch.Tensor,  # [T, out]
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [S, num_slices, R, in]
    lora_b: torch.Tensor,  # [S, out, R]
    slice_bounds: list[int],  # [num_slices + 1]
    token_slots: torch.Tensor,  # [T] int32, -1: none
) -> torch.Tensor:  # [T, out] in y's dtype
    """y + each token's delta, summed in float32 and rounded once to y's dtype."""
    delta = lora_delta_reference(x, lora_a, lora_b, slice_bounds, token_slots)
    return (y.float() + delta).to(y.dtype)
