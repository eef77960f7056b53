"""What a checkpoint gives for one linear layer's weight, before a method takes it.

    torch.Tensor  a float weight [out, in] (F32/F16/BF16 in any file, safetensors floats)
    GGUFWeight    GGUF blocks: one or more row ranges (shards), each of one ggml type
    Int8Weight    int8 [out, in] with a float32 scale per output row (W8A8, per channel)
    MXFP4Weight   MXFP4 blocks (gpt-oss's experts): 4-bit E2M1 values, an E8M0 exponent per 32

A fused layer (q/k/v, gate/up) concatenates its parts' rows. GGUF parts of one type become
one shard; parts of different types (a "Q4_K_M" file keeps v in Q6_K, q and k in Q4_K) stay
separate shards, each multiplied by its own kernel into its rows of the output.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class GGUFShard:
    """Rows of a GGUF-quantized matrix, as the file stores them."""

    qtype: int  # gguf.GGMLQuantizationType
    data: torch.Tensor  # uint8 [rows, row_bytes]: each row `in_features / block` blocks

    @property
    def rows(self) -> int:
        return int(self.data.shape[0])


@dataclasses.dataclass(frozen=True)
class GGUFWeight:
    """A GGUF-quantized weight [out, in]: its shards cover the output rows in order."""

    shards: tuple[GGUFShard, ...]
    in_features: int

    @property
    def out_features(self) -> int:
        return sum(s.rows for s in self.shards)


@dataclasses.dataclass(frozen=True)
class Int8Weight:
    """A symmetric per-channel int8 weight: W ≈ weight * scale[:, None]."""

    weight: torch.Tensor  # int8 [out, in]
    scale: torch.Tensor  # float32 [out]


@dataclasses.dataclass(frozen=True)
class MXFP4Weight:
    """An MXFP4 weight [out, in] as gpt-oss checkpoints store it (transformers' integrations/
    mxfp4.py): each row's values in groups of 32, a group 16 bytes of two E2M1 values (the low
    nibble first) and one E8M0 exponent; W[o, 32 g + j] = FP4[nibble j] * 2 ** (scale - 127)."""

    blocks: torch.Tensor  # uint8 [out, in / 32, 16]
    scales: torch.Tensor  # uint8 [out, in / 32]

    @property
    def out_features(self) -> int:
        return int(self.blocks.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.blocks.shape[1]) * 32


CheckpointWeight = torch.Tensor | GGUFWeight | Int8Weight | MXFP4Weight


def concat_rows(parts: list[CheckpointWeight]) -> CheckpointWeight:
    """The parts of a fused layer (q, k, v or gate, up) as one weight, rows in order."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        assert all(isinstance(p, torch.Tensor) for p in parts), "mixed float/quantized parts"
        return torch.cat(parts, dim=0)  # type: ignore[arg-type]  # all tensors, checked above
    if isinstance(first, Int8Weight):
        int8 = [p for p in parts if isinstance(p, Int8Weight)]
        assert len(int8) == len(parts), "mixed int8 and other parts"
        return Int8Weight(torch.cat([p.weight for p in int8]), torch.cat([p.scale for p in int8]))
    gguf = [p for p in parts if isinstance(p, GGUFWeight)]
    assert len(gguf) == len(parts), "mixed GGUF and other parts"
    shards: list[GGUFShard] = []
    for shard in (s for p in gguf for s in p.shards):
        if shards and shards[-1].qtype == shard.qtype:  # same type: one shard, rows joined
            shards[-1] = GGUFShard(shard.qtype, torch.cat([shards[-1].data, shard.data]))
        else:
            shards.append(shard)
    return GGUFWeight(tuple(shards), first.in_features)
