"""gpu-check, LoRA: the batched shrink/expand kernels (gpu_worker/kernels/lora/) against the
torch reference on mixed batches (adapters round-robin with base rows, and runs of one adapter
as prefill chunks), and their time against torch's per-adapter way and against the base
layer's own GEMM (the LoRA delta's share of a layer's time).

Imported only after cli.py has decided whether Triton interprets (CPU) or compiles (CUDA).
"""

from __future__ import annotations

from typing import Any

import torch

from gpu_worker.kernels.lora.kernel import lora_add
from gpu_worker.kernels.lora.reference import lora_add_reference
from tools.gpu_check.kernels import time_ms, tolerance

Row = dict[str, Any]
NUM_LORAS = 8
# (tokens, in_features, output slice widths, rank): a case of a check or a timing
LoraCase = tuple[int, int, tuple[int, ...], int]


def _inputs(
    case: LoraCase, pattern: str, dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[int], torch.Tensor]:
    tokens, k, widths, rank = case
    bounds = [0]
    for w in widths:
        bounds.append(bounds[-1] + w)
    gen = torch.Generator().manual_seed(tokens + k)
    a = torch.randn(NUM_LORAS, len(widths), rank, k, generator=gen) / k**0.5
    b = torch.randn(NUM_LORAS, bounds[-1], rank, generator=gen) / rank**0.5
    if pattern == "round-robin":  # a decode batch: every row another adapter, base rows too
        order = [t % (NUM_LORAS + 1) - 1 for t in range(tokens)]
    else:  # prefill chunks: NUM_LORAS runs of one adapter
        order = [t * NUM_LORAS // tokens for t in range(tokens)]
    slots = torch.tensor(order, dtype=torch.int32)
    x = torch.randn(tokens, k, generator=gen)
    y = torch.randn(tokens, bounds[-1], generator=gen)
    on = [t.to(device=device, dtype=dtype) for t in (y, x, a, b)]
    return on[0], on[1], on[2], on[3], bounds, slots.to(device)


def check_lora(case: LoraCase, pattern: str, dtype: torch.dtype, device: str) -> Row:
    y, x, a, b, bounds, slots = _inputs(case, pattern, dtype, device)
    ref = lora_add_reference(y, x, a, b, bounds, slots).float()
    lora_add(y, x, a, b, bounds, slots)
    err = (y.float() - ref).abs().max().item()
    tol = tolerance(dtype)
    tokens, k, _, rank = case
    return {"kernel": "lora", "shape": f"{k}->{bounds[1:]} r{rank}",
            "case": f"T={tokens} {pattern}", "dtype": str(dtype).removeprefix("torch."),
            "max_abs_err": err, "tolerance": tol, "ok": err <= tol}  # fmt: skip


def _torch_segments(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    bounds: list[int], slots: torch.Tensor) -> None:  # fmt: skip
    """torch's way: per adapter, its rows' x @ A^T @ B^T into y's slices (a host sync)."""
    for slot in slots.unique().tolist():
        if slot < 0:
            continue
        rows = (slots == slot).nonzero().flatten()
        for s in range(len(bounds) - 1):
            lo, hi = bounds[s], bounds[s + 1]
            y[rows, lo:hi] += (x[rows] @ a[slot, s].T) @ b[slot, lo:hi].T


def lora_speed(case: LoraCase, pattern: str, dtype: torch.dtype, device: str, iters: int) -> Row:
    y, x, a, b, bounds, slots = _inputs(case, pattern, dtype, device)
    weight = torch.randn(bounds[-1], x.shape[1], device=device, dtype=dtype)
    ours = time_ms(lambda: lora_add(y, x, a, b, bounds, slots), iters=iters)
    segments = time_ms(lambda: _torch_segments(y, x, a, b, bounds, slots), iters=iters)
    base = time_ms(lambda: torch.mm(x, weight.t()), iters=iters)
    tokens, k, _, rank = case
    return {
        "kernel": "lora", "tokens": tokens, "pattern": pattern, "in": k, "out": bounds[-1],
        "rank": rank, "adapters": NUM_LORAS, "dtype": str(dtype).removeprefix("torch."),
        "ours_ms": ours, "torch_segments_ms": segments, "base_mm_ms": base,
        "ours_over_base_mm": ours / base, "speedup_over_torch": segments / ours,
    }  # fmt: skip
