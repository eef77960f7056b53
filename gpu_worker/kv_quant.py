"""Quantized KV cache rows: `--kv-cache-dtype auto|int8|fp8|fp8_e4m3|fp8_e5m2` (vLLM's names).

A cache row is one token's K (or V) of one KV head. Quantized, it is stored in the row's own
bytes, so a block carries everything needed to read it back (a block copied, swapped or
written to a lower tier with its bytes is complete):

    int8      int8  [head_dim + 4]: head_dim values q, then the row's float32 scale s
              (the 4 bytes after the values, native byte order); x = q * s, s = max|x| / 127
              (a scale per token and head: writing a token never changes another token's
              bytes, so a token's K/V are the same bits in any batch, chunking or prefix share)
    fp8_e4m3  uint8 [head_dim]: the float8_e4m3fn bits of x (clamped to +-448), scale 1.0
    fp8_e5m2  uint8 [head_dim]: the float8_e5m2 bits of x (clamped to +-57344), scale 1.0
              (fp8 as vLLM stores it without calibrated k/v scales: one per-tensor scale of 1)

`auto` keeps the model's dtype (float32 or bfloat16), as before.
"""

from __future__ import annotations

import dataclasses

import torch

KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
SCALE_BYTES = 4  # an int8 row's float32 scale
INT8_MAX = 127.0
FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
FP8_TORCH = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# the C kernels' cache kinds (gpu_worker/cpu/paged_decode.c)
KIND_F32, KIND_BF16, KIND_INT8, KIND_FP8_E4M3, KIND_FP8_E5M2 = range(5)


def resolve_kv_cache_dtype(name: str) -> str:
    """`name` as one of auto, int8, fp8_e4m3, fp8_e5m2 (fp8 is e4m3, as in vLLM)."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {name!r}")
    return "fp8_e4m3" if name == "fp8" else name


@dataclasses.dataclass(frozen=True)
class KVFormat:
    """How a cache row is stored: `name` (auto, int8, fp8_e4m3, fp8_e5m2), the model's float
    `dtype` (what auto stores, and what rows read back as)."""

    name: str
    dtype: torch.dtype

    @classmethod
    def create(cls, name: str, dtype: torch.dtype) -> KVFormat:
        return cls(resolve_kv_cache_dtype(name), dtype)

    @property
    def quantized(self) -> bool:
        return self.name != "auto"

    @property
    def storage_dtype(self) -> torch.dtype:
        """The cache tensor's dtype."""
        if self.name == "auto":
            return self.dtype
        return torch.int8 if self.name == "int8" else torch.uint8

    def row_width(self, head_dim: int) -> int:
        """Elements of storage_dtype per row (the cache tensor's last dimension)."""
        if self.name == "int8":
            if head_dim % SCALE_BYTES:
                raise ValueError(f"kv_cache_dtype int8 needs head_dim % 4 == 0, got {head_dim}")
            return head_dim + SCALE_BYTES
        return head_dim

    def head_dim(self, row_width: int) -> int:
        return row_width - SCALE_BYTES if self.name == "int8" else row_width

    @property
    def kind(self) -> int:
        """The C kernels' code for this format."""
        if self.name == "auto":
            return KIND_BF16 if self.dtype == torch.bfloat16 else KIND_F32
        return {"int8": KIND_INT8, "fp8_e4m3": KIND_FP8_E4M3, "fp8_e5m2": KIND_FP8_E5M2}[self.name]

    def describe(self) -> str:
        """The KV dtype for logs and stats: the float dtype for auto, else the format."""
        return str(self.dtype).removeprefix("torch.") if self.name == "auto" else self.name

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """Rows x [..., head_dim] (any float dtype) as stored: [..., row_width(head_dim)]."""
        if self.name == "auto":
            return x.to(self.dtype)
        xf = x.float()
        if self.name == "int8":
            amax = xf.abs().amax(dim=-1, keepdim=True)
            scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
            q = torch.round(xf / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
            return torch.cat((q, scale.contiguous().view(torch.int8)), dim=-1)
        limit = FP8_MAX[self.name]
        return xf.clamp(-limit, limit).to(FP8_TORCH[self.name]).view(torch.uint8)

    def dequantize(self, rows: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Stored rows [..., row_width] back to [..., head_dim] in `dtype` (the model's)."""
        dtype = dtype or self.dtype
        if self.name == "auto":
            return rows.to(dtype)
        if self.name == "int8":
            d = rows.shape[-1] - SCALE_BYTES
            scale = rows[..., d:].contiguous().view(torch.float32)
            return (rows[..., :d].float() * scale).to(dtype)
        return rows.contiguous().view(FP8_TORCH[self.name]).float().to(dtype)
