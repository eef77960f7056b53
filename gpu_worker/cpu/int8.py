"""int8 W8A8 linear layers on the CPU: int8 weights with one float scale per output row
(symmetric), activations quantized dynamically per row (per token), int32 sums.

What vLLM's CPU backend serves from compressed-tensors W8A8 checkpoints. Every row of x has
its own scale, so a sequence's output does not depend on the rest of its batch; the sums are
exact integers and every float step (the epilogue `((float)sum * w_scale) * x_scale + bias`)
is computed the same way whichever path took the row, so a row's result is bitwise the same
in any batch.

Paths, chosen per call by the number of rows (docs/benchmarks.md, "int8 W8A8"):
  few rows (decode)   the C kernel (int8.c): per-row quantization, VNNI / AVX2 dot products
  many rows (prefill) oneDNN's int8 GEMM on a weight pre-packed once (`pack_weight`), with x
                      quantized by the C kernel and the epilogue in C; only where the CPU has
                      VNNI (AVX512-VNNI, AVX-VNNI or AMX): without it oneDNN's int8 sums
                      saturate (measured: off by 7% of the largest sum with
                      ONEDNN_MAX_CPU_ISA=AVX2). Elsewhere (or without a packed weight) torch's
                      float32 GEMM on the integer values, which sums them exactly.
  no C compiler       torch: the same quantization, `torch._int_mm`, the same epilogue.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from common.cpu_features import cpu_flags
from gpu_worker.cpu.build import KernelLibrary

SOURCE = Path(__file__).with_name("int8.c")
# the most rows of x the C kernel takes when a packed weight offers oneDNN for more: 4 rows
# tie on SmolLM2's layers, at 8 oneDNN (AMX) is as fast or faster (docs/benchmarks.md)
MAX_KERNEL_ROWS = 4
# more rows than this, without a packed weight, go to the float32 GEMM on the integers: with
# AVX2 alone the C kernel is 2x slower than float32 at 512 rows, on par at 16 (an AVX2 build
# on an AVX-512 CPU: not measured on an AVX2-only CPU)
MAX_KERNEL_ROWS_UNPACKED = 16
# the float32 GEMM's sums stay exact integers over this many products (127 * 128 * 1024 < 2**24)
EXACT_K = 1024
OUT_BLOCK = 8192  # weight rows widened to float32 at a time (32 MiB at in = 1024)
# CPU flags with which oneDNN sums int8 products exactly (u8 x s8 -> s32 instructions)
VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
QMAX = 127


def _declare(lib: ctypes.CDLL) -> None:
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.int8_linear_rows.restype = i
    lib.int8_linear_rows.argtypes = [p, i, p, p, p, p, i, i, i]
    lib.int8_quantize_rows.restype = i
    lib.int8_quantize_rows.argtypes = [p, i, i, p, p, i]
    lib.int8_finish_rows.restype = i
    lib.int8_finish_rows.argtypes = [p, i, p, p, p, i, i]


_LIBRARY = KernelLibrary(SOURCE, _declare, "CPU int8 linear kernel")


def load() -> ctypes.CDLL | None:
    """The kernel library (built on first use), or None when it cannot be had."""
    return _LIBRARY.load()


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-row int8 of a float weight [out, in]: (int8 [out, in], float32
    scale [out]) with scale = max|row| / 127 (1 for an all-zero row) and w ~ q * scale."""
    wf = w.detach().to(torch.float32)
    amax = wf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    q = torch.round(wf / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row dynamic int8 of x [rows, in], in torch, as the C kernel does it: (int8 [rows,
    in], float32 scale [rows]); scale = max|row| / 127, q = round(x * (127 / max|row|))
    (half to even), an all-zero row gets scale 0."""
    xf = x.to(torch.float32)
    amax = xf.abs().amax(dim=1)
    inv = torch.where(amax > 0, QMAX / amax, torch.zeros_like(amax))
    q = torch.round(xf * inv[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, amax / QMAX


def can_pack() -> bool:
    """Whether many rows go to oneDNN's int8 GEMM here: oneDNN available and the CPU sums int8
    products exactly (VNNI_FLAGS)."""
    return torch.backends.mkldnn.is_available() and any(f in cpu_flags() for f in VNNI_FLAGS)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """int8 `weight` [out, in] in oneDNN's blocked layout, for int8_linear's many-row path (an
    opaque tensor; a second copy of the weight)."""
    return torch.ops.onednn.qlinear_prepack(weight.detach().contiguous(), None)


def _flat(x: torch.Tensor, in_features: int) -> torch.Tensor:
    if x.shape[-1] != in_features:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {in_features}")
    return x.reshape(-1, in_features).to(torch.float32).contiguous()


def _kernel(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    y: torch.Tensor,
) -> None:
    code = lib.int8_linear_rows(
        x.data_ptr(), x.shape[0], weight.data_ptr(), scale.data_ptr(),
        bias.data_ptr() if bias is not None else None, y.data_ptr(),
        weight.shape[0], weight.shape[1], torch.get_num_threads(),
    )  # fmt: skip
    if code != 0:
        raise RuntimeError(f"int8_linear_rows failed ({code})")


def _quantize(lib: ctypes.CDLL, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xq = torch.empty(x.shape, dtype=torch.int8)
    xs = torch.empty(x.shape[0], dtype=torch.float32)
    code = lib.int8_quantize_rows(
        x.data_ptr(), x.shape[0], x.shape[1], xq.data_ptr(), xs.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if code != 0:
        raise RuntimeError(f"int8_quantize_rows failed ({code})")
    return xq, xs


def _finish(
    lib: ctypes.CDLL,
    sums: torch.Tensor,
    xs: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """The C kernel's epilogue, in place, on exact sums [rows, out] held as float32."""
    lib.int8_finish_rows(
        sums.data_ptr(), sums.shape[0], xs.data_ptr(), scale.data_ptr(),
        bias.data_ptr() if bias is not None else None, sums.shape[1], torch.get_num_threads(),
    )  # fmt: skip
    return sums


def _onednn(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    xq, xs = _quantize(lib, x)
    out = scale.shape[0]
    ones, zero_points = torch.ones(out), torch.zeros(out, dtype=torch.int64)
    # every scale 1: oneDNN's output is the exact int32 sums, as float32
    sums = torch.ops.onednn.qlinear_pointwise(
        xq, 1.0, 0, packed, ones, zero_points, None, 1.0, 0, torch.float32, "none", [], ""
    ).contiguous()
    return _finish(lib, sums, xs, scale, bias)


def _float_gemm(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """Exact int32 sums by torch's float32 GEMM on the integers: every product (<= 127 * 128)
    and every partial sum of EXACT_K of them is below 2**24, so float32 holds them exactly
    whatever order the GEMM adds in; slices of EXACT_K are added in float64 (exact), rounded
    once to float32 as the C kernel rounds its int32 sums. The weight is widened per call,
    OUT_BLOCK rows at a time."""
    xq, xs = _quantize(lib, x)
    xf = xq.to(torch.float32)
    out, in_features = weight.shape
    sums = torch.empty(x.shape[0], out, dtype=torch.float32)
    for o0 in range(0, out, OUT_BLOCK):
        w = weight[o0 : o0 + OUT_BLOCK]
        if in_features <= EXACT_K:
            sums[:, o0 : o0 + len(w)] = xf @ w.to(torch.float32).t()
            continue
        acc = torch.zeros(x.shape[0], len(w), dtype=torch.float64)
        for k0 in range(0, in_features, EXACT_K):
            k = slice(k0, k0 + EXACT_K)
            acc += xf[:, k] @ w[:, k].to(torch.float32).t()
        sums[:, o0 : o0 + len(w)] = acc
    return _finish(lib, sums, xs, scale, bias)


def int8_linear_torch(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """int8_linear of x [rows, in] float32 in torch (the path without a C compiler): the
    same quantization, exact int32 sums (`torch._int_mm`), the same float epilogue; a row's
    result is bitwise the C kernel's."""
    xq, xs = quantize_rows(x)
    y = torch._int_mm(xq, weight.t()).to(torch.float32).mul_(scale).mul_(xs[:, None])
    return y.add_(bias) if bias is not None else y


def int8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., in] (float32 or bfloat16) @ dequantized weight.T (+ bias), with x quantized per
    row; returns x's dtype, shape [..., out]. `weight` int8 [out, in], `weight_scale` float32
    [out]; `packed` (pack_weight's, where can_pack()) sends more than MAX_KERNEL_ROWS rows to
    oneDNN; without it more than MAX_KERNEL_ROWS_UNPACKED go to the float32 GEMM."""
    if weight.dtype != torch.int8 or weight.dim() != 2:
        raise ValueError(f"weight must be int8 [out, in], got {weight.dtype} {tuple(weight.shape)}")
    out_features, in_features = weight.shape
    xf = _flat(x, in_features)
    scale = weight_scale.to(torch.float32).contiguous()
    bf = bias.to(torch.float32).contiguous() if bias is not None else None
    rows, lib = xf.shape[0], load()
    if rows == 0:
        y = xf.new_empty(0, out_features)
    elif lib is None:
        y = int8_linear_torch(xf, weight, scale, bf)
    elif packed is not None and rows > MAX_KERNEL_ROWS:
        y = _onednn(lib, xf, packed, scale, bf)
    elif rows > MAX_KERNEL_ROWS_UNPACKED and torch.get_float32_matmul_precision() == "highest":
        y = _float_gemm(lib, xf, weight, scale, bf)  # (no bf16 or tf32 float32 matmuls)
    else:
        y = torch.empty(rows, out_features, dtype=torch.float32)
        _kernel(lib, xf, weight.contiguous(), scale, bf, y)
    return y.reshape(*x.shape[:-1], out_features).to(x.dtype)


def reference_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """What int8_linear computes, in float32 torch: x quantized and dequantized per row, times
    the dequantized weight (+ bias), [rows, out]."""
    xq, xs = quantize_rows(x.reshape(-1, x.shape[-1]))
    w = weight.to(torch.float32) * weight_scale.to(torch.float32)[:, None]
    y = (xq.to(torch.float32) * xs[:, None]) @ w.t()
    return y + bias.to(torch.float32) if bias is not None else y
