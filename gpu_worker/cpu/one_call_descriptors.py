"""The one-call step's C structs (one_call_step.c's decode_linear_t, decode_moe_t,
decode_layer_t) and the descriptors the linear methods build of their weights
(`LinearMethod.one_call_linear`, gpu_worker/layers/linear.py): which kernel and which bytes
the C loop reads for a layer, its bias and LoRA slots, and `Keep`, which holds what they
point at beside the model's parameters. No kernel is called here: the step itself is
one_call_step.py."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Protocol

import torch

from gpu_worker.cpu.moe import MoEExperts

_P = ctypes.c_void_p
MAX_SHARDS = 4  # one_call_step.c's
LIN_F32, LIN_BF16, LIN_GGUF, LIN_INT8 = range(4)  # one_call_step.c's decode_linear_t kinds


class DecodeLinear(ctypes.Structure):
    """one_call_step.c's decode_linear_t: one linear layer's weight as its method keeps it,
    its bias and its LoRA slots (lora_a NULL: none)."""

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


class DecodeMoE(ctypes.Structure):
    """one_call_step.c's decode_moe_t: a sparse layer's router, routing, experts (moe.c),
    Qwen2-MoE's shared expert, and the step's tokens per expert."""

    _fields_ = [
        ("router", DecodeLinear),
        ("top_k", ctypes.c_int),
        ("scoring", ctypes.c_int),
        ("renormalize", ctypes.c_int),
        ("experts", MoEExperts),
        ("shared_gate_up", DecodeLinear),
        ("shared_down", DecodeLinear),
        ("shared_gate", DecodeLinear),
        ("shared_width", ctypes.c_int),
        ("counts", _P),
    ]


class DecodeLayer(ctypes.Structure):
    """one_call_step.c's decode_layer_t: one layer's norms, linears or sparse MLP, sliding
    window, q/k norms and sinks."""

    _fields_ = [
        ("input_norm", _P),
        ("post_norm", _P),
        ("qkv", DecodeLinear),
        ("o", DecodeLinear),
        ("gate_up", DecodeLinear),
        ("down", DecodeLinear),
        ("window", ctypes.c_int),
        ("inter", ctypes.c_int),
        ("q_norm", _P),
        ("k_norm", _P),
        ("qk_norm_whole", ctypes.c_int),
        ("sinks", _P),
        ("moe", ctypes.POINTER(DecodeMoE)),
    ]


def float_linear(weight: torch.Tensor) -> DecodeLinear | None:
    """A float32 or bfloat16 weight [out, in] (linear.c), or None when it is not contiguous."""
    if not weight.is_contiguous():
        return None
    desc = DecodeLinear(nshards=1)
    desc.kind = LIN_BF16 if weight.dtype == torch.bfloat16 else LIN_F32
    desc.w[0] = weight.data_ptr()
    return desc


def gguf_linear(shards: Sequence[tuple[torch.Tensor, int, int]]) -> DecodeLinear | None:
    """GGUF blocks (gguf.c): each shard's (bytes, ggml type, rows), in row order; None past
    MAX_SHARDS."""
    if len(shards) > MAX_SHARDS:
        return None
    desc = DecodeLinear(kind=LIN_GGUF, nshards=len(shards))
    for s, (w, qtype, rows) in enumerate(shards):
        desc.w[s], desc.qtype[s], desc.rows[s] = w.data_ptr(), qtype, rows
    return desc


def int8_linear(weight: torch.Tensor, scale: torch.Tensor) -> DecodeLinear:
    """int8 W8A8 (int8.c): weight int8 [out, in], scale float32 [out]."""
    desc = DecodeLinear(kind=LIN_INT8, nshards=1, scale=scale.data_ptr())
    desc.w[0] = weight.data_ptr()
    return desc


class LoraSlots(Protocol):
    """The step's adapter slot of each token, -1 for none (gpu_worker/lora/layer.py's
    LoraMapping): `buffer[:num_tokens]` int32; `active` when a token has an adapter."""

    @property
    def active(self) -> bool: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def buffer(self) -> torch.Tensor: ...


class Keep:
    """What the descriptors point at beside the model's parameters, alive as long as they
    are: float32 copies (a bf16 model's norms, biases and rotary tables) and the token slots
    the layers' LoRA descriptors read (set by the LoRA method, one mapping per model)."""

    def __init__(self) -> None:
        self.copies: list[torch.Tensor] = []
        self.lora: LoraSlots | None = None
        self.structs: list[ctypes.Structure] = []  # the sparse layers' DecodeMoE

    def float32(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """t as a contiguous float32 tensor (a copy, kept here, when it is not)."""
        if t is None or (t.dtype == torch.float32 and t.is_contiguous()):
            return t
        copy = t.detach().to(torch.float32).contiguous()
        self.copies.append(copy)
        return copy


def with_lora(
    desc: DecodeLinear,
    lora_a: torch.Tensor,  # [loras, slices, rank, in]
    lora_b: torch.Tensor,  # [loras, out, rank]
    bounds: torch.Tensor,  # [slices + 1] int32
) -> DecodeLinear:
    """desc plus a layer's LoRA slots (lora.c's a, b and slice bounds)."""
    desc.lora_a, desc.lora_b, desc.lora_bounds = (
        lora_a.data_ptr(),
        lora_b.data_ptr(),
        bounds.data_ptr(),
    )
    desc.lora_bf16 = int(lora_a.dtype == torch.bfloat16)
    desc.lora_loras, desc.lora_slices, desc.lora_rank = lora_a.shape[:3]
    return desc
