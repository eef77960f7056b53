"""Linear layers that send a few rows to the C kernel (linear.c) and the rest to torch.

A decode step of one to a few sequences multiplies [rows <= 8, in] activations by every
weight of the model, and is bound by reading those weights; torch's BLAS path for such thin
products reads them at a third of the memory bandwidth (docs/benchmarks.md, "Peers"). The C
kernel streams each weight row once for all rows of x. Prefill chunks and large decode
batches (compute-bound) go to oneDNN with the weight (float32 or bfloat16) pre-packed once at
load into its blocked layout (`torch.ops.mkldnn._linear_pointwise`, what vLLM's CPU backend and
torch.compile's CPU freezing do): torch's default path, MKL's sgemm, repacks the weight on
every call and on AMD CPUs does not reach oneDNN's throughput (docs/benchmarks.md). The
packed copy costs a second copy of the weights in memory.

`gpu_worker/layers/linear_methods/cpu_float.py` calls these for a float CPU model's layers (chosen
at load by gpu_worker/layers/kernel_choice.py when the library can be built). Float32 and bfloat16
weights; activations are fed to the kernel in float32 and the result cast back to the
layer's dtype.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

from gpu_worker.cpu.build import KernelLibrary

SOURCE = Path(__file__).with_name("linear.c")
# the most rows of x the kernel takes, per weight dtype: where it stopped beating torch's
# fp32 GEMM and bf16 oneDNN path on a 2-core AVX-512 EPYC (not measured on AVX2-only CPUs)
MAX_ROWS = {torch.float32: 8, torch.bfloat16: 4}
# the batch size oneDNN picks the packed layout for: a prefill chunk's order of rows
PACK_ROWS_HINT = 256


def _declare(lib: ctypes.CDLL) -> None:
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.linear_small.restype = i
    lib.linear_small.argtypes = [p, i, p, i, p, p, i, i, i]
    lib.linear_gemm.restype = i
    lib.linear_gemm.argtypes = [p, i, p, p, p, i, i, i]


_LIBRARY = KernelLibrary(
    SOURCE, _declare, "CPU small-batch linear kernel", (Path(__file__).with_name("bf16.h"),)
)


def load() -> ctypes.CDLL | None:
    """The kernel library (built on first use), or None when it cannot be had."""
    return _LIBRARY.load()


def _takes(lib: ctypes.CDLL | None, x: torch.Tensor, weight: torch.Tensor, rows: int) -> bool:
    """Whether the C kernels take x [1..rows, in] against weight (both on the CPU)."""
    return (
        lib is not None
        and x.dim() == 2
        and 0 < x.shape[0] <= rows
        and x.device.type == "cpu"
        and weight.is_contiguous()
    )


def _call(
    fn: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *mid: int
) -> torch.Tensor | None:
    """y = fn(x, rows, w, *mid, bias, y, out, in, threads) in float32; None if it refused."""
    out_features, in_features = weight.shape
    xf = x.to(torch.float32).contiguous()
    bf = bias.to(torch.float32).contiguous() if bias is not None else None
    y = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    code = fn(
        xf.data_ptr(),
        x.shape[0],
        weight.data_ptr(),
        *mid,
        bf.data_ptr() if bf is not None else None,
        y.data_ptr(),
        out_features,
        in_features,
        torch.get_num_threads(),
    )
    return y if code == 0 else None


def linear_small(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """x [rows, in] @ weight.T (+ bias) by the C kernel, in x's dtype; None when the kernel
    does not take these inputs (the caller uses torch)."""
    lib = load()
    if lib is None or not _takes(lib, x, weight, MAX_ROWS.get(weight.dtype, 0)):
        return None
    y = _call(lib.linear_small, x, weight, bias, int(weight.dtype == torch.bfloat16))
    return y if y is None or x.dtype == torch.float32 else y.to(x.dtype)


PANEL = 16  # linear.c's GEMM_PW: outputs a panel of a packed GEMM weight


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """float32 weight [..., out, in] in linear.c's GEMM layout: [..., ceil(out / PANEL), in,
    PANEL], panel p holding outputs [p * PANEL, (p + 1) * PANEL) (those past `out` zero), one
    vector load a step of `in` for PANEL outputs."""
    *lead, out, in_features = weight.shape
    panels = -(-out // PANEL)
    if panels * PANEL != out:  # a copy only where outputs must be added
        weight = torch.nn.functional.pad(weight, (0, 0, 0, panels * PANEL - out))
    return weight.reshape(*lead, panels, PANEL, in_features).transpose(-1, -2).contiguous()


def unpack_panels(panels: torch.Tensor, out: int) -> torch.Tensor:
    """pack_panels' weight [..., out, in] again (a copy)."""
    *lead, n, in_features, width = panels.shape
    return panels.transpose(-1, -2).reshape(*lead, n * width, in_features)[..., :out, :]


def linear_gemm(
    x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out: int
) -> torch.Tensor | None:
    """x [rows, in] @ W.T (+ bias) for float32 x and a float32 weight W [out, in] packed by
    pack_panels, any number of rows, by linear.c's GEMM whose every output is the same bits
    whatever the rows beside it (a float expert's rows vary with the batch); None when the
    kernel does not take these inputs."""
    lib = load()
    if (
        lib is None
        or x.dtype != torch.float32
        or panels.dtype != torch.float32
        or panels.dim() != 3
        or panels.shape[0] * PANEL < out
        or not _takes(lib, x, panels, 1 << 30)
        or x.shape[1] != panels.shape[1]
    ):
        return None
    xf = x.contiguous()
    bf = bias.to(torch.float32).contiguous() if bias is not None else None
    y = torch.empty(x.shape[0], out, dtype=torch.float32)
    code = lib.linear_gemm(
        xf.data_ptr(), x.shape[0], panels.data_ptr(), bf.data_ptr() if bf is not None else None,
        y.data_ptr(), out, x.shape[1], torch.get_num_threads(),
    )  # fmt: skip
    return y if code == 0 else None


def can_pack(dtype: torch.dtype) -> bool:
    """Whether weights of `dtype` go to oneDNN pre-packed for many rows: float32 and
    bfloat16 when torch has oneDNN (bf16 F.linear takes oneDNN too, but packs the weight on
    every call: pre-packed, a 64-row decode's linears ran 321 -> 397 GFLOP/s, a 512-row
    prefill chunk's 400 -> 424, on a 2-core AVX512_BF16 EPYC). oneDNN packs bf16 only where
    the CPU has AVX-512 BW/VL/DQ or AVX-NE-CONVERT (it raises elsewhere: an AVX2-only CPU)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] in oneDNN's blocked layout for linear_packed (an opaque tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)


def linear_packed(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ weight.T (+ bias) by oneDNN on a weight from pack_weight."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [None], "")
