"""MXFP4 linear rows on the CPU (mxfp4.c): gpt-oss's experts multiplied from their packed bytes.

The weight stays as the checkpoint stores it (gpu_worker/layers/linear_methods/weights.py's
MXFP4Weight: per output row, 16 bytes of 32 E2M1 values and one E8M0 exponent per group);
the kernel unpacks one group of a row to 32 floats and dots it with each row of x, so a
row's result never depends on the other rows of its call (the same bits alone or in any
batch). x is taken in float32 (a bf16 model's rows are widened, the result cast back).
`dequantize` is the same unpacking to a float matrix: the torch reference's weights.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from gpu_worker.cpu.build import KernelLibrary

SOURCE = Path(__file__).with_name("mxfp4.c")
GROUP = 32


def _declare(lib: ctypes.CDLL) -> None:
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.mxfp4_linear_rows.restype = i
    lib.mxfp4_linear_rows.argtypes = [p, i, i, p, p, p, i, p, i]
    lib.mxfp4_dequantize.restype = i
    lib.mxfp4_dequantize.argtypes = [p, p, i, i, p]


_LIBRARY = KernelLibrary(SOURCE, _declare, "CPU MXFP4 kernel")


def load() -> ctypes.CDLL | None:
    """The kernel library (built on first use), or None when it cannot be had."""
    return _LIBRARY.load()


def _check(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[int, int]:
    out, groups = int(blocks.shape[0]), int(blocks.shape[1])
    if (
        blocks.dtype != torch.uint8
        or scales.dtype != torch.uint8
        or tuple(blocks.shape) != (out, groups, GROUP // 2)
        or tuple(scales.shape) != (out, groups)
        or not (blocks.is_contiguous() and scales.is_contiguous())
        or blocks.device.type != "cpu"
    ):
        raise ValueError(
            f"MXFP4 blocks must be contiguous uint8 [out, in/32, 16] with scales uint8 "
            f"[out, in/32] on the CPU, got {blocks.dtype} {list(blocks.shape)} and "
            f"{scales.dtype} {list(scales.shape)}"
        )
    return out, groups * GROUP


def linear_rows(
    x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """x [rows, in] @ W.T (+ bias) [rows, out] in x's dtype, W the MXFP4 weight; None when
    the library cannot be had."""
    lib = load()
    if lib is None:
        return None
    out, n_in = _check(blocks, scales)
    if x.shape[-1] != n_in:
        raise ValueError(f"x has {x.shape[-1]} features, the MXFP4 weight {n_in}")
    xf = x.to(torch.float32).contiguous()
    bf = None if bias is None else bias.to(torch.float32).contiguous()
    y = torch.empty(xf.shape[0], out, dtype=torch.float32)
    code = lib.mxfp4_linear_rows(
        xf.data_ptr(), xf.shape[0], n_in, blocks.data_ptr(), scales.data_ptr(),
        None if bf is None else bf.data_ptr(), out, y.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if code != 0:
        raise RuntimeError(f"mxfp4_linear_rows failed ({code})")
    return y.to(x.dtype)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor | None:
    """The float32 weight [out, in] by the kernel's unpacking; None without the library."""
    lib = load()
    if lib is None:
        return None
    out, n_in = _check(blocks, scales)
    w = torch.empty(out, n_in, dtype=torch.float32)
    code = lib.mxfp4_dequantize(blocks.data_ptr(), scales.data_ptr(), out, n_in, w.data_ptr())
    if code != 0:
        raise RuntimeError(f"mxfp4_dequantize failed ({code})")
    return w
