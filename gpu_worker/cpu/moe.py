"""A mixture of experts' layer on the CPU in one C call (moe.c): the routing (`route`: router
logits to each token's top-k experts and weights), the experts (`experts`: the step's tokens
grouped by expert with a stable counting sort, each selected expert's rows through its
weight's kernel, reading only the selected experts' bytes, then each token's weighted sum),
and Qwen2-MoE's gated shared expert (`add_gated`). A token's result is the same bits alone or
in any batch, and the same as the one-call step's (one_call_step.c includes moe.c).

The CPU MoE methods (gpu_worker/layers/moe_methods/) give their experts as `MoEExperts`
descriptors (the constructors here); the methods and the CPU layer ops call these functions
for float32 activations and keep torch otherwise (None from a function: not taken)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from gpu_worker.cpu.build import KernelLibrary
from gpu_worker.cpu.gguf import HEADERS

HERE = Path(__file__).parent
SOURCE = HERE / "moe.c"
INCLUDES = (
    *(HERE / name for name in ("linear.c", "gguf.c", "int8.c", "layers.c", "mxfp4.c")),
    HERE / "bf16.h",
    *HEADERS,
)
MAX_TOP_K = 64  # moe.c's per-token slot buffer
MAX_EXPERTS = 1024  # moe.c's per-token score buffer
SCORINGS = {"softmax": 0, "topk_softmax": 1}  # moe.c's MOE_SOFTMAX, MOE_TOPK_SOFTMAX
ACTIVATIONS = {"silu": 0, "swiglu_clamp": 1}  # moe.c's MOE_SILU, MOE_SWIGLU_CLAMP
KIND_F32, KIND_BF16, KIND_GGUF, KIND_INT8, KIND_MXFP4 = range(5)  # moe.c's MOE_* kinds
_P = ctypes.c_void_p


class MoEExperts(ctypes.Structure):
    """moe.c's moe_experts_t: one layer's experts as its method keeps them, their biases and
    their activation."""

    _fields_ = [
        ("kind", ctypes.c_int),
        ("num_experts", ctypes.c_int),
        ("width", ctypes.c_int),
        ("hidden", ctypes.c_int),
        ("w13", _P),
        ("w2", _P),
        ("s13", _P),
        ("s2", _P),
        ("qt13", ctypes.c_int),
        ("qt2", ctypes.c_int),
        ("b13", _P),
        ("b2", _P),
        ("activation", ctypes.c_int),
        ("limit", ctypes.c_float),
        ("alpha", ctypes.c_float),
    ]


def _declare(lib: ctypes.CDLL) -> None:
    p, i = _P, ctypes.c_int
    lib.moe_route.restype = i
    lib.moe_route.argtypes = [p, i, i, i, i, i, p, p]
    lib.moe_experts.restype = i
    lib.moe_experts.argtypes = [ctypes.POINTER(MoEExperts), p, i, p, p, i, p, p, i]
    lib.moe_add_gated.restype = None
    lib.moe_add_gated.argtypes = [p, p, p, i, i]


_LIBRARY = KernelLibrary(SOURCE, _declare, "CPU MoE kernel", INCLUDES)


def load() -> ctypes.CDLL | None:
    """The kernel library (built on first use), or None when it cannot be had."""
    return _LIBRARY.load()


# --- the descriptors, as the MoE methods give them -----------------------------------------


def experts_desc(
    kind: int,
    w13: torch.Tensor,  # [E, 2 * width, ...] as the kind keeps it
    w2: torch.Tensor,  # [E, hidden, ...]
    width: int,
    hidden: int,
    *,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    qtypes: tuple[int, int] = (0, 0),
    biases: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    activation: str = "silu",
    limit: float = 7.0,
    alpha: float = 1.702,
) -> MoEExperts | None:
    """A layer's experts for moe.c (see moe_experts_t), or None when a tensor is not
    contiguous or a bias not float32 on the CPU (the caller keeps its own path)."""
    tensors = [w13, w2, *(scales or ()), *(b for b in biases if b is not None)]
    if any(not t.is_contiguous() or t.device.type != "cpu" for t in tensors):
        return None
    if any(b is not None and b.dtype != torch.float32 for b in biases):
        return None
    desc = MoEExperts(kind=kind, num_experts=w13.shape[0], width=width, hidden=hidden)
    desc.w13, desc.w2 = w13.data_ptr(), w2.data_ptr()
    if scales is not None:
        desc.s13, desc.s2 = scales[0].data_ptr(), scales[1].data_ptr()
    desc.qt13, desc.qt2 = qtypes
    desc.b13, desc.b2 = (None if b is None else b.data_ptr() for b in biases)
    desc.activation = ACTIVATIONS[activation]
    desc.limit, desc.alpha = limit, alpha
    return desc


# --- the layer's parts, one C call each -----------------------------------------------------


def route(
    logits: torch.Tensor, top_k: int, scoring: str, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(weights [T, k] float32, expert ids [T, k] int64) for float32 router logits [T, E] on
    the CPU (moe_routing.py's select_experts, in moe.c's arithmetic); None for anything else."""
    lib = load()
    num_tokens, num_experts = logits.shape
    if (
        lib is None
        or logits.dtype != torch.float32
        or logits.device.type != "cpu"
        or top_k > MAX_TOP_K
        or (scoring == "softmax" and num_experts > MAX_EXPERTS)
    ):
        return None
    x = logits.contiguous()
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64)
    code = lib.moe_route(
        x.data_ptr(), num_tokens, num_experts, top_k, SCORINGS[scoring], int(renormalize),
        weights.data_ptr(), ids.data_ptr(),
    )  # fmt: skip
    return (weights, ids) if code == 0 else None


def experts(
    desc: MoEExperts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, list[int]] | None:
    """(The layer's output [T, H] float32, each expert's (token, slot) pairs) for float32 x
    [T, H] routed to ids [T, k] with weights [T, k]; None when the kernel does not take them
    (no library, another dtype, a kind or shape it does not take): the caller loops in
    Python."""
    lib = load()
    num_tokens, top_k = ids.shape
    if (
        lib is None
        or num_tokens == 0
        or top_k > MAX_TOP_K
        or x.dtype != torch.float32
        or x.device.type != "cpu"
    ):
        return None
    xf = x.contiguous()
    ids64 = ids.to(torch.int64).contiguous()
    wf = weights.to(torch.float32).contiguous()
    y = torch.empty(num_tokens, desc.hidden, dtype=torch.float32)
    counts = torch.zeros(desc.num_experts, dtype=torch.int64)
    code = lib.moe_experts(
        ctypes.byref(desc), xf.data_ptr(), num_tokens, ids64.data_ptr(), wf.data_ptr(), top_k,
        y.data_ptr(), counts.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if code == 1:
        return None
    if code != 0:
        raise RuntimeError(f"moe_experts failed ({code})")
    return y, counts.tolist()


def add_gated(out: torch.Tensor, shared: torch.Tensor, gate: torch.Tensor) -> torch.Tensor | None:
    """out + sigmoid(gate [T, 1]) * shared [T, H] (a new tensor) for float32 tensors on the
    CPU; None for anything else."""
    lib = load()
    tensors = (out, shared, gate)
    if lib is None or any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
        return None
    y = out.contiguous().clone()
    s, g = shared.contiguous(), gate.contiguous()
    lib.moe_add_gated(y.data_ptr(), s.data_ptr(), g.data_ptr(), y.shape[0], y.shape[1])
    return y
