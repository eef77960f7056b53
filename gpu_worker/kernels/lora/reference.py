"""The LoRA delta in plain torch: the ground truth for `kernel`. The formula of
gpu_worker/lora/layer.py's docstring, written per token (each token's A and B gathered by its
slot) where lora_delta_reference goes per slot: two spellings of one formula, which the
tests compare too. Imports nothing of the worker (a kernel is a leaf)."""

from __future__ import annotations

import torch


def lora_add_reference(
    y: torch.Tensor,  # [T, out]
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [S, num_slices, R, in]
    lora_b: torch.Tensor,  # [S, out, R]
    slice_bounds: list[int],  # [num_slices + 1]
    token_slots: torch.Tensor,  # [T] int32, -1: none
) -> torch.Tensor:  # [T, out] in y's dtype
    """y + each token's delta, summed in float32 and rounded once to y's dtype."""
    slots = token_slots.long()
    on = slots >= 0
    idx = slots.clamp(min=0)
    z = torch.einsum("tcri,ti->tcr", lora_a[idx].float(), x.float())  # [T, C, R]
    widths = [hi - lo for lo, hi in zip(slice_bounds, slice_bounds[1:], strict=False)]
    col_slice = torch.repeat_interleave(torch.arange(len(widths)), torch.tensor(widths))
    z_cols = z[:, col_slice.to(z.device)]  # [T, out, R]: each column's slice's z
    delta = (lora_b[idx].float() * z_cols).sum(-1) * on[:, None]
    return (y.float() + delta).to(y.dtype)
