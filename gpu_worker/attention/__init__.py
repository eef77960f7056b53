"""Attention backends behind one interface; `torch` runs everywhere and is the CPU default."""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import torch

from gpu_worker.attention.metadata import AttentionMetadata, build_metadata
from gpu_worker.kv_quant import KVFormat


class AttentionBackend(abc.ABC):
    """Stores a step's new K/V into the paged cache and attends over each request's context.

    One instance serves every layer of a model. `build_metadata` runs once per step and may
    add backend-specific fields (masks, index lists) to the common metadata; `forward` runs
    once per layer with that metadata and the layer's cache
    `kv_cache [2, num_blocks, block_size, num_kv_heads, row_width]` (row_width: head_dim, or
    the quantized row of `kv_cache_dtype`, gpu_worker/kv_quant.py: the backend quantizes each
    new token's K and V as it stores them, once, and reads the quantized rows back).

    Scores are q.k * `scale` (head_dim ** -0.5 unless the model says otherwise: Gemma's
    query_pre_attn_scalar ** -0.5), soft-capped to softcap * tanh(s / softcap) where
    `softcap` > 0 (Gemma 2's attn_logit_softcapping), then masked and softmaxed.
    """

    name: ClassVar[str]
    # a decode step reads only device tensors (no host numbers): CUDA graphs can capture it
    supports_cuda_graphs: ClassVar[bool] = False
    # decodes run the CPU's C kernel (gpu_worker/cpu/paged_decode.c), the one the one-call
    # step attends with (the torch backend on the CPU sets it)
    cpu_decode_kernel: bool = False

    def __init__(
        self,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        scale: float | None = None,
        softcap: float = 0.0,
        kv_cache_dtype: str = "auto",
    ) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} heads do not split into {num_kv_heads} KV heads")
        if softcap < 0:
            raise ValueError(f"softcap must be >= 0 (0: none), got {softcap}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.scale = head_dim**-0.5 if scale is None else scale
        self.softcap = softcap
        self.kv_format = KVFormat.create(kv_cache_dtype, dtype)

    def build_metadata(self, common: AttentionMetadata) -> AttentionMetadata:
        """Per-step extras for this backend; the common metadata alone by default."""
        return common

    @abc.abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        window: int = 0,
        sinks: torch.Tensor | None = None,  # [num_heads] float32
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Store k/v at meta.slot_mapping, then attend; returns the attention output. With a
        sliding `window` > 0 a query at position i sees the keys at i - window < j <= i
        (transformers' sliding_window), else every key up to its own position. `sinks`
        (gpt-oss): a learned logit per head that joins each softmax as a key with no value,
        so the weights of the real keys sum to less than 1."""


BACKEND_NAMES = ("auto", "torch", "triton")


def resolve_backend_name(name: str, device: torch.device | str) -> str:
    """`auto` -> `triton` on CUDA when triton is installed, else `torch`; others unchanged."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; known: {list(BACKEND_NAMES)}")
    if name != "auto":
        return name
    from gpu_worker.kernels import triton_available

    return "triton" if torch.device(device).type == "cuda" and triton_available() else "torch"


def create_backend(name: str, **kwargs: Any) -> AttentionBackend:
    """The backend called `name` (or `auto`, resolved for kwargs["device"]), constructed
    with AttentionBackend's keyword arguments. Only the triton backend imports triton."""
    if name == "auto":
        name = resolve_backend_name(name, kwargs["device"])
    if name == "torch":
        from gpu_worker.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(**kwargs)
    if name == "triton":
        from gpu_worker.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(**kwargs)
    raise ValueError(f"unknown attention backend {name!r}; known: {list(BACKEND_NAMES)}")


__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "build_metadata",
    "create_backend",
    "resolve_backend_name",
]
