"""A mixture of experts' layer on GGUF experts in one C call (moe.c): the step's tokens grouped
by expert (a stable counting sort) and each selected expert's rows run through gguf.c's
few-row or GEMM kernel, reading only the selected experts' bytes; a token's result is the same
bits alone or in any batch. `GGUFMoEMethod` (gpu_worker/layers/moe_methods/gguf.py) calls it
for its "cpu" kernel; without the library it keeps its per-expert Python loop."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from gpu_worker.cpu.build import KernelLibrary
from gpu_worker.cpu.gguf import HEADERS

SOURCE = Path(__file__).with_name("moe.c")
INCLUDES = (Path(__file__).with_name("gguf.c"), *HEADERS)
MAX_TOP_K = 64  # moe.c's per-token slot buffer


def _declare(lib: ctypes.CDLL) -> None:
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.gguf_moe.restype = i
    lib.gguf_moe.argtypes = [p, i, p, p, i, i, p, i, p, i, i, i, p, p, i]


_LIBRARY = KernelLibrary(SOURCE, _declare, "CPU MoE kernel", INCLUDES)


def load() -> ctypes.CDLL | None:
    """The kernel library (built on first use), or None when it cannot be had."""
    return _LIBRARY.load()


def gguf_moe(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    qtype13: int,
    w2: torch.Tensor,
    qtype2: int,
    width: int,
) -> tuple[torch.Tensor, list[int]] | None:
    """(The layer's output [T, H] in x's dtype, each expert's (token, slot) pairs) for x
    [T, H] routed to ids [T, k] with weights [T, k]; w13 uint8 [E, 2 * width, row_bytes] and
    w2 uint8 [E, H, row_bytes] the experts' GGUF bytes. None when the kernel does not take
    them (no library, a type or shape it does not take): the caller loops in Python."""
    lib = load()
    num_tokens, top_k = ids.shape
    if lib is None or num_tokens == 0 or top_k > MAX_TOP_K or x.device.type != "cpu":
        return None
    num_experts, hidden = w13.shape[0], x.shape[1]
    xf = x.to(torch.float32).contiguous()
    ids64 = ids.to(torch.int64).contiguous()
    wf = weights.to(torch.float32).contiguous()
    y = torch.empty(num_tokens, hidden, dtype=torch.float32)
    counts = torch.zeros(num_experts, dtype=torch.int64)
    code = lib.gguf_moe(
        xf.data_ptr(), num_tokens, ids64.data_ptr(), wf.data_ptr(), top_k, num_experts,
        w13.data_ptr(), qtype13, w2.data_ptr(), qtype2, width, hidden,
        y.data_ptr(), counts.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if code == 1:
        return None
    if code != 0:
        raise RuntimeError(f"gguf_moe failed ({code})")
    return y.to(x.dtype), counts.tolist()
