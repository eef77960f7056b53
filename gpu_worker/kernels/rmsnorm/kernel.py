"""RMSNorm and fused residual-add + RMSNorm in Triton: one program per row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_worker.kernels import check_device, next_power_of_2


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h += tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        # the residual stream lives in the model dtype: normalise the rounded sum, as torch does
        h_rounded = h.to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, h_rounded, mask=mask)
        h = h_rounded.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(h * h, 0) / hidden + eps)
    normed = (h * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _check_2d(name: str, t: torch.Tensor, like: torch.Tensor) -> None:
    assert t.shape == like.shape, f"{name} {tuple(t.shape)} != {tuple(like.shape)}"
    assert t.dtype == like.dtype, f"{name} is {t.dtype}, x is {like.dtype}"
    assert t.stride(1) == 1, f"{name} rows must be contiguous"


def _launch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    assert x.dim() == 2 and x.stride(1) == 1, "x must be [rows, hidden] with contiguous rows"
    assert weight.shape == (x.shape[1],) and weight.is_contiguous(), "weight must be [hidden]"
    out = torch.empty_like(x)
    residual_out = None if residual is None else torch.empty_like(x)
    if residual is not None:
        _check_2d("residual", residual, x)
        check_device(x, weight, residual)
    else:
        check_device(x, weight)
    if x.shape[0] == 0:
        return out, residual_out
    hidden = x.shape[1]
    block = next_power_of_2(hidden)
    _rms_norm_kernel[(x.shape[0],)](
        x, x if residual is None else residual, weight, out,
        out if residual_out is None else residual_out,
        x.stride(0), 0 if residual is None else residual.stride(0), out.stride(0),
        out.stride(0) if residual_out is None else residual_out.stride(0),
        hidden, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
    )  # fmt: skip
    return out, residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [rows, hidden] normalised per row and scaled by weight [hidden]; a new tensor."""
    return _launch(x, weight, eps, None)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the normalised rows and the new residual."""
    out, residual_out = _launch(x, weight, eps, residual)
    assert residual_out is not None
    return out, residual_out
