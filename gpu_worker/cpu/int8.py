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
                      ONEDNN_MAX_CPU_ISA=AVX2), so AVX2-only CPUs keep the C kernel.
  no C compiler       torch: the same quantization, exact sums (`torch._int_mm` with VNNI,
                      else the float32 GEMM on the integer values), the same epilogue.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from common.cpu_features import cpu_flags
from gpu_worker.cpu.build import KernelLibrary

SOURCE = Path(__file__).with_name("int8.c")
# the most rows of x the C kernel takes when a packed weight offers oneDNN for more: 4 rows
# tie on SmolLM2's layers, from 8 oneDNN (AMX here) is as fast or faster (docs/benchmarks.md)
MAX_KERNEL_ROWS = 4
# the float32 GEMM's sums stay exact integers over this many products (127 * 128 * 1024 < 2**24)
EXACT_K = 1024
# the CPU flag with which oneDNN runs its int8 GEMMs, exactly and fast: with VNNI alone (an
# AMD EPYC Zen 4: avx512_vnni, no AMX) torch 2.13's oneDNN runs qlinear on its reference
# implementation (`ref_int8:any` in ONEDNN_VERBOSE: 300 ms for 64 x 576 x 576, a test that
# takes seconds ran 10 minutes), and without VNNI its sums saturate (off by 7% of the largest
# sum, measured with ONEDNN_MAX_CPU_ISA=AVX2); the C kernel takes every row count there
ONEDNN_INT8_FLAGS = ("amx_int8",)
QMAX = 127
# the widest rows whose int32 sums cannot overflow (127 * 128 * MAX_IN_FEATURES < 2**31): int8.c
MAX_IN_FEATURES = 131072


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


def quantize_weight(
    w: torch.Tensor, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-row int8 of a float weight [out, in]: (int8 [out, in], float32
    scale [out]) with scale = max|row| / 127 (1 for an all-zero row) and w ~ q * scale. The
    scale is first rounded to `scale_dtype` (a checkpoint's), and q rounded against that."""
    wf = w.detach().to(torch.float32)
    amax = wf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    scale = scale.to(scale_dtype).to(torch.float32)
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
    """Whether oneDNN's int8 GEMMs (and `torch._int_mm`) are exact and fast here: oneDNN
    available and a CPU with ONEDNN_INT8_FLAGS (see there)."""
    return torch.backends.mkldnn.is_available() and any(f in cpu_flags() for f in ONEDNN_INT8_FLAGS)


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """int8 `weight` [out, in] in oneDNN's blocked layout for int8_linear's many-row path (an
    opaque tensor, a second copy of the weight), or None where can_pack() is False."""
    if not can_pack():
        return None
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


def _onednn(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x quantized by the C kernel, oneDNN's exact int32 sums (as float32: every scale 1), the
    C kernel's epilogue in place."""
    rows, in_features, out = x.shape[0], x.shape[1], scale.shape[0]
    xq = torch.empty(rows, in_features, dtype=torch.int8)
    xs = torch.empty(rows, dtype=torch.float32)
    threads = torch.get_num_threads()
    if lib.int8_quantize_rows(x.data_ptr(), rows, in_features, xq.data_ptr(), xs.data_ptr(),
                              threads) != 0:  # fmt: skip
        raise RuntimeError("int8_quantize_rows failed")
    ones, zero_points = torch.ones(out), torch.zeros(out, dtype=torch.int64)
    sums = torch.ops.onednn.qlinear_pointwise(
        xq, 1.0, 0, packed, ones, zero_points, None, 1.0, 0, torch.float32, "none", [], ""
    ).contiguous()
    lib.int8_finish_rows(sums.data_ptr(), rows, xs.data_ptr(), scale.data_ptr(),
                         bias.data_ptr() if bias is not None else None, out, threads)  # fmt: skip
    return sums


def exact_sums(xq: torch.Tensor, weight: torch.Tensor, int_mm: bool | None = None) -> torch.Tensor:
    """xq [rows, in] int8 @ weight.T int8, exactly, as float32 [rows, out] (each sum rounded
    once, as the C kernel converts its int32 sums): `torch._int_mm` where it is exact
    (can_pack()), else torch's float32 GEMM on the integer values: every product (<= 127 * 128)
    and every partial sum of EXACT_K of them is below 2**24, so float32 holds them exactly in
    any order of addition; slices of EXACT_K are added in float64. `int_mm` forces a choice."""
    if can_pack() if int_mm is None else int_mm:
        return torch._int_mm(xq, weight.t()).to(torch.float32)
    xf = xq.to(torch.float32)
    if xq.shape[1] <= EXACT_K:
        return xf @ weight.to(torch.float32).t()
    acc = torch.zeros(xq.shape[0], weight.shape[0], dtype=torch.float64)
    for k0 in range(0, xq.shape[1], EXACT_K):
        k = slice(k0, k0 + EXACT_K)
        acc += xf[:, k] @ weight[:, k].to(torch.float32).t()
    return acc.to(torch.float32)


def int8_linear_torch(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """int8_linear of x [rows, in] float32 in torch (the path without a C compiler): the
    same quantization, exact sums, the same float epilogue; a row's result is bitwise the C
    kernel's."""
    xq, xs = quantize_rows(x)
    y = exact_sums(xq, weight).mul_(scale).mul_(xs[:, None])
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
    [out]; `packed` (pack_weight's) sends more than MAX_KERNEL_ROWS rows to oneDNN."""
    if weight.dtype != torch.int8 or weight.dim() != 2:
        raise ValueError(f"weight must be int8 [out, in], got {weight.dtype} {tuple(weight.shape)}")
    out_features, in_features = weight.shape
    if in_features > MAX_IN_FEATURES:
        raise ValueError(f"{in_features} input features: int32 sums take {MAX_IN_FEATURES}")
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
