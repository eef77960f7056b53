"""gpu-check, quantized GEMMs: the GGUF block-format and W8A8 int8 kernels against their
float32 references, and their time against dequantize-then-`torch.mm` (what a linear layer
without them does every call) and against `torch.mm` on weights dequantized once.

Imported only after cli.py has decided whether Triton interprets (CPU) or compiles (CUDA).
Needs torch and triton only: GGUF weights are valid random blocks, no gguf-py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gpu_worker.kernels.gguf_matmul.kernel import gguf_matmul
from gpu_worker.kernels.gguf_matmul.reference import (
    GGUF_BLOCKS,
    QTYPE_NAMES,
    dequantize_reference,
    gguf_matmul_reference,
    random_gguf_weight,
)
from gpu_worker.kernels.int8_matmul.kernel import int8_matmul
from gpu_worker.kernels.int8_matmul.reference import (
    int8_matmul_reference,
    quantize_rows_reference,
)
from tools.gpu_check.kernels import time_ms, tolerance

Row = dict[str, Any]
QTYPES = tuple(GGUF_BLOCKS)


def _gguf_inputs(
    qtype: int, m: int, n: int, k: int, dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    weight = random_gguf_weight(qtype, n, k, seed=qtype, scale=1e-3, device=device)
    return torch.randn(m, k, dtype=dtype, device=device), weight


def _int8_inputs(
    m: int, n: int, k: int, dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    weight, scale = quantize_rows_reference(torch.randn(n, k, device=device))
    return torch.randn(m, k, dtype=dtype, device=device), weight, scale


def _row(kernel: str, shape: str, case: str, dtype: torch.dtype, out: torch.Tensor,
         ref: torch.Tensor) -> Row:  # fmt: skip
    # GEMM outputs grow with K and the weights' scales: the error is taken on outputs
    # normalised by the largest reference value, so the O(1) tolerances of kernels.py apply
    err = ((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
    tol = tolerance(dtype)
    return {"kernel": kernel, "shape": shape, "case": case,
            "dtype": str(dtype).removeprefix("torch."), "max_abs_err": err, "tolerance": tol,
            "ok": err <= tol}  # fmt: skip


def check_gguf(qtype: int, m: int, n: int, k: int, dtype: torch.dtype, device: str) -> Row:
    x, weight = _gguf_inputs(qtype, m, n, k, dtype, device)
    out = gguf_matmul(x, weight, qtype, n, k)
    ref = gguf_matmul_reference(x, weight, qtype)
    return _row("gguf_matmul", f"{QTYPE_NAMES[qtype]} {n}x{k}", f"M={m} (normalised)", dtype,
                out, ref)  # fmt: skip


def check_int8(m: int, n: int, k: int, dtype: torch.dtype, device: str) -> Row:
    x, weight, scale = _int8_inputs(m, n, k, dtype, device)
    out = int8_matmul(x, weight, scale)
    ref = int8_matmul_reference(x, weight, scale)
    return _row("int8_matmul", f"W8A8 {n}x{k}", f"M={m} (normalised)", dtype, out, ref)


def _speed(kernel: str, fmt: str, m: int, weight: torch.Tensor, dtype: torch.dtype,
           ours: Callable[[], object], dequantize: Callable[[], torch.Tensor],
           x: torch.Tensor, iters: int) -> Row:  # fmt: skip
    ours_ms = time_ms(ours, iters=iters)
    dequant_ms = time_ms(lambda: torch.mm(x, dequantize().to(dtype).t()), iters=iters)
    dense = dequantize().to(dtype)
    mm_ms = time_ms(lambda: torch.mm(x, dense.t()), iters=iters)
    n, k = dense.shape
    return {
        "kernel": kernel, "format": fmt, "m": m, "n": n, "k": k,
        "dtype": str(dtype).removeprefix("torch."),
        "ours_ms": ours_ms, "dequant_mm_ms": dequant_ms, "mm_ms": mm_ms,
        "ours_over_dequant_mm": dequant_ms / ours_ms, "ours_over_mm": mm_ms / ours_ms,
        "weight_GBps": weight.numel() * weight.element_size() / (ours_ms * 1e-3) / 1e9,
        "TFLOPs": 2.0 * m * n * k / (ours_ms * 1e-3) / 1e12,
    }  # fmt: skip


def gguf_speed(qtype: int, m: int, n: int, k: int, dtype: torch.dtype, device: str,
               iters: int) -> Row:  # fmt: skip
    x, weight = _gguf_inputs(qtype, m, n, k, dtype, device)
    out = torch.empty(m, n, dtype=dtype, device=device)
    return _speed("gguf_matmul", QTYPE_NAMES[qtype], m, weight, dtype,
                  lambda: gguf_matmul(x, weight, qtype, n, k, out=out),
                  lambda: dequantize_reference(weight, qtype, k), x, iters)  # fmt: skip


def int8_speed(m: int, n: int, k: int, dtype: torch.dtype, device: str, iters: int) -> Row:
    x, weight, scale = _int8_inputs(m, n, k, dtype, device)
    out = torch.empty(m, n, dtype=dtype, device=device)
    return _speed("int8_matmul", "W8A8", m, weight, dtype,
                  lambda: int8_matmul(x, weight, scale, out=out),
                  lambda: weight.float() * scale[:, None], x, iters)  # fmt: skip
