"""Linear layers on GGUF block-format weights (Q4_0 ... Q6_K) by the C kernels of gguf.c.

The weight is the GGUF tensor's raw bytes, a uint8 tensor [out_features, row_bytes] (one row
of the matrix = in_features / block_values blocks, laid out as ggml stores them). Each row of
x is quantized to int8 per 32 values (per row, so a row's output never depends on the other
rows of its batch). Up to GgufKernels.few_rows() rows (decode: 4 or 8 by type, 16 for Q4_0,
Q4_1 and Q8_0 where the GEMM runs on AMX) go to the few-row kernel, which streams the
weights once in their block format; more rows (prefill chunks, big decode
batches) to an int8 GEMM on 8 or 16 weight rows at a time (Q4_0, Q4_1, Q5_0, Q5_1; Q8_0 on
CPUs with VNNI), on AMX int8 tiles where the CPU has them and Linux grants the process their
state (gguf_amx.h; the AVX GEMM elsewhere); CPUs without AVX2 dequantize to float32 and
multiply with torch.
The int8 paths do the same float operations in the same order, so a row's result is the
same bits in a batch of any size (K-quants take the few-row kernel for every row count):
greedy tokens never depend on the batch, the chunking or a speculative verification.

`GgufKernels(march)` holds one built library: this CPU's instruction set by default, another
(`"haswell"`: AVX2 only) for tests. The module functions use this CPU's.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from gpu_worker.cpu.build import KernelLibrary

SOURCE = Path(__file__).with_name("gguf.c")
HEADERS = tuple(
    Path(__file__).with_name(n) for n in ("gguf.h", "gguf_rows.h", "gguf_gemm.h", "gguf_amx.h")
)
_T = gguf.GGMLQuantizationType
SUPPORTED = frozenset({_T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q8_0, _T.Q4_K, _T.Q5_K, _T.Q6_K})
# the most rows of x the few-row kernel takes; more go to the int8 GEMM: where the two met for
# SmolLM2's shapes (ms, 2 threads, tools/benchmarks/gguf_kernels.py, weights hot: Q4_1
# [1536, 576] at 4 / 8 rows 0.063 / 0.108 vs 0.060 / 0.074, Q8_0 [49152, 576] 1.75 / 3.04 vs
# 1.98 / 2.31; on a busy 2-core Sapphire Rapids). Q4_0, Q4_1 (whose few-row kernel pairs
# weight rows) and Q8_0 take up to 8 rows, one pass of the kernel: gguf.h's gguf_few_rows,
# the same choice, with its figures
MAX_KERNEL_ROWS = 4
EIGHT_ROW_TYPES = frozenset({_T.Q4_0, _T.Q4_1, _T.Q8_0})


def few_rows(qtype: int) -> int:
    """The most rows of x the few-row kernel takes for weights of GGUF type `qtype` where the
    GEMM runs on AVX (GgufKernels.few_rows: twice as many where it runs on AMX tiles)."""
    return 8 if qtype in EIGHT_ROW_TYPES else MAX_KERNEL_ROWS


# many rows on a matrix of more float32 bytes than TILE_ABOVE_BYTES dequantize it TILE_BYTES at
# a time: SmolLM2's [49152, 576] vocabulary at 64 rows 86 -> 36 ms (at 512 rows 400 -> 420-450;
# its other matrices, whole or tiled, within noise), one thread of a busy Sapphire Rapids
TILE_ABOVE_BYTES = 8 << 20
TILE_BYTES = 1 << 20
# gguf_linear_many_path's path argument per GEMM path name ("rows" and "f32" are other entries)
_PATHS = {"rows": -1, "f32": -1, "many": 0, "many_avx": 1, "amx": 2}


def _declare(lib: ctypes.CDLL) -> None:
    p, i = ctypes.c_void_p, ctypes.c_int
    for name in ("gguf_linear_rows", "gguf_linear_rows_f32", "gguf_linear_many"):
        fn = getattr(lib, name)
        fn.restype = i
        fn.argtypes = [p, i, p, i, p, p, i, i, i]
    lib.gguf_linear_many_path.restype = i
    lib.gguf_linear_many_path.argtypes = [p, i, p, i, p, p, i, i, i, i]
    lib.gguf_amx_available.restype = i
    lib.gguf_amx_available.argtypes = []
    lib.gguf_few_rows_here.restype = i
    lib.gguf_few_rows_here.argtypes = [i]
    lib.gguf_dequantize.restype = i
    lib.gguf_dequantize.argtypes = [p, i, p, i, i, i]
    lib.gguf_sum_bytes.restype = ctypes.c_uint64
    lib.gguf_sum_bytes.argtypes = [p, ctypes.c_int64, i]


def supported_types() -> frozenset[int]:
    """The gguf.GGMLQuantizationType values these kernels take."""
    return frozenset(SUPPORTED)


def row_bytes(qtype: int, in_features: int) -> int:
    """Bytes of one weight row of `in_features` values in `qtype`."""
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[_T(qtype)]
    if in_features % block_values:
        raise ValueError(f"in_features {in_features} is not a multiple of {block_values}")
    return in_features // block_values * block_bytes


def _check_weight(weight: torch.Tensor, qtype: int, out_features: int, in_features: int) -> None:
    if qtype not in SUPPORTED:
        raise ValueError(f"GGUF type {qtype} is not one of {sorted(SUPPORTED)}")
    shape = (out_features, row_bytes(qtype, in_features))
    if weight.dtype != torch.uint8 or tuple(weight.shape) != shape or weight.device.type != "cpu":
        raise ValueError(
            f"weight must be uint8 {shape} on the CPU, got {weight.dtype} {weight.shape}"
        )
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous")


class GgufKernels:
    """The GGUF kernels of one library built for `march` ("native": this CPU)."""

    def __init__(self, march: str = "native") -> None:
        self._library = KernelLibrary(
            SOURCE, _declare, f"GGUF CPU kernels ({march})", HEADERS, march
        )
        self._few: dict[int, int] = {}

    def load(self) -> ctypes.CDLL | None:
        """The library (built on first use), or None when it cannot be had."""
        return self._library.load()

    def few_rows(self, qtype: int) -> int:
        """The most rows of x `linear` gives the few-row kernel for GGUF type `qtype`: gguf.c's
        gguf_few_rows_here (the module's few_rows, doubled where the GEMM runs on AMX tiles,
        whose rows would be slower there)."""
        most = self._few.get(qtype)
        if most is None:
            lib = self.load()
            most = few_rows(qtype) if lib is None else int(lib.gguf_few_rows_here(qtype))
            self._few[qtype] = most
        return most

    def _lib(self) -> ctypes.CDLL:
        lib = self.load()
        if lib is None:
            raise RuntimeError("the GGUF CPU kernel library could not be built")
        return lib

    def linear_rows(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        qtype: int,
        out_features: int,
        in_features: int,
        bias: torch.Tensor | None = None,
        path: str = "rows",
    ) -> torch.Tensor:
        """x [rows, in] float32 @ W.T (+ bias) -> [rows, out] float32, W in its block format:
        by the few-row int8 kernel ("rows"), the int8 GEMM ("many": on AMX tiles where
        available, else "many_avx"), the GEMM on AVX registers only ("many_avx": VNNI or
        AVX2), the GEMM on AMX tiles only ("amx"), or each weight row dequantized and
        multiplied in float32 ("f32"). ValueError where the path does not take the type on
        this CPU (the GEMM: Q4_0, Q4_1, Q5_0, Q5_1; Q8_0 with VNNI; "amx" only where
        `amx_available()`)."""
        y, code = self._run(path, x, weight, qtype, out_features, in_features, bias)
        if code == 1:
            raise ValueError(f"the {path!r} path does not take type {qtype} on this CPU")
        return y

    def linear_many(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        qtype: int,
        out_features: int,
        in_features: int,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """As linear_rows by the int8 GEMM; None where it does not take the type here."""
        y, code = self._run("many", x, weight, qtype, out_features, in_features, bias)
        return None if code == 1 else y

    def _run(
        self,
        path: str,
        x: torch.Tensor,
        weight: torch.Tensor,
        qtype: int,
        out_features: int,
        in_features: int,
        bias: torch.Tensor | None,
    ) -> tuple[torch.Tensor, int]:
        _check_weight(weight, qtype, out_features, in_features)
        xf = x.to(torch.float32).contiguous()
        if xf.dim() != 2 or xf.shape[1] != in_features:
            raise ValueError(f"x must be [rows, {in_features}], got {tuple(x.shape)}")
        y = torch.empty(xf.shape[0], out_features, dtype=torch.float32)
        if xf.shape[0] == 0:
            return y, 0
        bf = bias.to(torch.float32).contiguous() if bias is not None else None
        lib = self._lib()
        if path not in _PATHS:
            raise ValueError(f"path must be one of {sorted(_PATHS)}, got {path!r}")
        args = (
            xf.data_ptr(),
            xf.shape[0],
            weight.data_ptr(),
            int(qtype),
            bf.data_ptr() if bf is not None else None,
            y.data_ptr(),
            out_features,
            in_features,
            torch.get_num_threads(),
        )
        if path == "rows":
            code = lib.gguf_linear_rows(*args)
        elif path == "f32":
            code = lib.gguf_linear_rows_f32(*args)
        else:
            code = lib.gguf_linear_many_path(*args, _PATHS[path])
        if code not in (0, 1):
            raise RuntimeError(f"GGUF {path} kernel failed ({code})")
        return y, code

    def amx_available(self) -> bool:
        """Whether the GEMM runs on AMX int8 tiles here: the library was built with AMX-INT8
        (this CPU has it) and Linux granted the process the tile state."""
        lib = self.load()
        return lib is not None and bool(lib.gguf_amx_available())

    def dequantize(
        self, weight: torch.Tensor, qtype: int, out_features: int, in_features: int
    ) -> torch.Tensor:
        """W [out, in] float32 from its GGUF bytes [out, row_bytes]."""
        _check_weight(weight, qtype, out_features, in_features)
        y = torch.empty(out_features, in_features, dtype=torch.float32)
        if self.load() is None:  # gguf-py's numpy dequantization: slow, same values
            values = gguf.quants.dequantize(weight.numpy(), _T(qtype))
            return y.copy_(torch.from_numpy(np.ascontiguousarray(values)))
        return self._dequantize_into(weight, qtype, y)

    def _dequantize_into(self, weight: torch.Tensor, qtype: int, y: torch.Tensor) -> torch.Tensor:
        code = self._lib().gguf_dequantize(
            weight.data_ptr(),
            int(qtype),
            y.data_ptr(),
            y.shape[0],
            y.shape[1],
            torch.get_num_threads(),
        )
        if code != 0:
            raise RuntimeError(f"gguf_dequantize failed ({code})")
        return y

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        qtype: int,
        out_features: int,
        in_features: int,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [..., in] (float32 or bfloat16) @ W.T (+ bias) in x's dtype: the few-row int8
        kernel for up to self.few_rows(qtype) rows, the int8 GEMM beyond where it takes the type
        (both give a row the same bits), the few-row kernel for every row count elsewhere
        (K-quants); dequantization + torch only without the library."""
        x2 = x.reshape(-1, in_features)
        y: torch.Tensor | None = None
        if x2.shape[0] > 0 and self.load() is not None:
            if x2.shape[0] > self.few_rows(qtype):
                y = self.linear_many(x2, weight, qtype, out_features, in_features, bias)
            if y is None:  # few rows, or a type the GEMM does not take: the same bits
                y = self.linear_rows(x2, weight, qtype, out_features, in_features, bias)
        if y is None:
            y = self.linear_float(x2, weight, qtype, out_features, in_features, bias)
        return y.to(x.dtype).reshape(*x.shape[:-1], out_features)

    def linear_float(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        qtype: int,
        out_features: int,
        in_features: int,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [rows, in] @ W.T (+ bias) in float32 by torch on W dequantized to float32, whole
        (up to TILE_ABOVE_BYTES of float32) or a tile of TILE_BYTES at a time (a matrix too
        large for the caches is then never written out): K-quants' many rows."""
        x32 = x.to(torch.float32)
        bf = bias.to(torch.float32) if bias is not None else None
        if out_features * in_features * 4 <= TILE_ABOVE_BYTES or self.load() is None:
            return F.linear(x32, self.dequantize(weight, qtype, out_features, in_features), bf)
        _check_weight(weight, qtype, out_features, in_features)
        tile_rows = max(16, TILE_BYTES // (4 * in_features))
        y = torch.empty(x32.shape[0], out_features, dtype=torch.float32)
        tile = torch.empty(tile_rows, in_features, dtype=torch.float32)
        for lo in range(0, out_features, tile_rows):
            hi = min(out_features, lo + tile_rows)
            w = self._dequantize_into(weight[lo:hi], qtype, tile[: hi - lo])
            y[:, lo:hi] = x32 @ w.T
        return y if bf is None else y.add_(bf)

    def sum_bytes(self, data: torch.Tensor) -> int:
        """The sum of a contiguous uint8 tensor's bytes (the memory read limit, measured)."""
        if data.dtype != torch.uint8 or not data.is_contiguous():
            raise ValueError("data must be a contiguous uint8 tensor")
        return int(
            self._lib().gguf_sum_bytes(data.data_ptr(), data.numel(), torch.get_num_threads())
        )


_NATIVE = GgufKernels()


def load() -> ctypes.CDLL | None:
    """This CPU's kernel library (built on first use), or None when it cannot be had."""
    return _NATIVE.load()


def gguf_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    qtype: int,
    out_features: int,
    in_features: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., in] (float32 or bfloat16) @ W.T (+ bias) in x's dtype; W is the GGUF tensor's
    bytes, uint8 [out_features, row_bytes], of a type in supported_types()."""
    return _NATIVE.linear(x, weight, qtype, out_features, in_features, bias)


def dequantize(
    weight: torch.Tensor, qtype: int, out_features: int, in_features: int
) -> torch.Tensor:
    """W [out_features, in_features] float32 from its GGUF bytes [out_features, row_bytes]."""
    return _NATIVE.dequantize(weight, qtype, out_features, in_features)
