"""The one-call decode step's kernel (decode_step.c): every decoder layer of a decode step of
a few sequences in one C call, built once with gcc and called via ctypes.

A leaf: it knows C structs, pointers and shapes, not the model. gpu_worker/models/
one_call_step.py reads a model's layers (their norms and their linear methods' weights) into
`DecodeLayer` descriptors and calls `decode_forward`.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from gpu_worker.cpu.build import KernelLibrary

HERE = Path(__file__).parent
SOURCE = HERE / "decode_step.c"
INCLUDES = (
    HERE / "bf16.h",
    HERE / "linear.c",
    HERE / "gguf.c",
    HERE / "gguf.h",
    HERE / "gguf_rows.h",
    HERE / "gguf_gemm.h",
    HERE / "int8.c",
    HERE / "layers.c",
    HERE / "lora.c",
    HERE.parent / "attention" / "cpu_paged_decode.c",
)
_P = ctypes.c_void_p
MAX_SHARDS = 4  # decode_step.c's
LIN_F32, LIN_BF16, LIN_GGUF, LIN_INT8 = range(4)  # decode_step.c's decode_linear_t kinds


class DecodeLinear(ctypes.Structure):
    """decode_step.c's decode_linear_t: one linear layer's weight as its method keeps it, and
    its LoRA slots (lora_a NULL: none)."""

    _fields_ = [
        ("kind", ctypes.c_int),
        ("nshards", ctypes.c_int),
        ("w", _P * MAX_SHARDS),
        ("qtype", ctypes.c_int * MAX_SHARDS),
        ("rows", ctypes.c_int * MAX_SHARDS),
        ("scale", _P),
        ("b", _P),
        ("lora_a", _P),
        ("lora_b", _P),
        ("lora_bounds", _P),
        ("lora_bf16", ctypes.c_int),
        ("lora_slices", ctypes.c_int),
        ("lora_rank", ctypes.c_int),
        ("lora_loras", ctypes.c_int),
    ]


class DecodeLayer(ctypes.Structure):
    """decode_step.c's decode_layer_t: one layer's norms and linears."""

    _fields_ = [
        ("input_norm", _P),
        ("post_norm", _P),
        ("qkv", DecodeLinear),
        ("o", DecodeLinear),
        ("gate_up", DecodeLinear),
        ("down", DecodeLinear),
    ]


def _declare(lib: ctypes.CDLL) -> None:
    i, f, i64 = ctypes.c_int, ctypes.c_float, ctypes.c_int64
    lib.decode_forward.restype = i
    lib.decode_forward.argtypes = [
        *(_P, i, _P, i, i, i, i, i, i, f),  # layers .. eps
        *(_P, _P, _P, _P, _P, i64, i64),  # cos .. half_stride
        *(_P, i, _P, i, f, i, _P, i),  # tables .. kv_bf16, lora_slots, nthreads
    ]


_LIBRARY = KernelLibrary(SOURCE, _declare, "CPU decode-step kernel", INCLUDES)


def load() -> ctypes.CDLL | None:
    """The kernel library (built on first use), or None when it cannot be had."""
    return _LIBRARY.load()
