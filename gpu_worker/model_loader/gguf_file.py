"""Read a GGUF file's tensors as they are stored, keyed by Hugging Face names.

    read_gguf_config(path)   -> HF-style config dict (LlamaConfig.from_hf takes it)
    read_gguf_tensors(path)  -> {hf_name: GGUFTensor}
    dequantize_tensor(t)     -> float32 torch tensor (gguf-py's reference dequantisation)
    gguf_weights_version(path)

A GGUFTensor of a float type (F32, F16, BF16) holds a torch tensor of that dtype in torch
shape (out, in); one of a block type (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) holds
the file's bytes row by row, uint8 [out, row_bytes], for a quantized linear layer to use as
they are. Both view a copy-on-write memory map of the file: nothing is read until used.

llama.cpp's converter permutes the rows of q and k of a "llama" file so that rotary pairs
are adjacent (GPT-J style); our model rotates halves (NeoX style, as Hugging Face does):

    file row  (head h, pair p, half i)   <-   HF row  (head h, half i, pair p)

Undoing it moves whole rows, so it applies to a block type's uint8 rows unchanged.

Gemma's RMSNorm multiplies by (1 + weight); llama.cpp's converter stores every Gemma norm
weight with the 1 added (a Gemma 2 or 3 file). The reader takes it off, in float32 (as
transformers' GGUF loader does), so the weights are the Hugging Face checkpoint's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.gguf_families import GEMMA_ARCHITECTURES
from common.gguf_meta import (
    CONFIG_TENSORS,
    PERMUTED_ARCHITECTURES,
    SUPPORTED_TYPES,
    UnsupportedTensorType,
    check_tensor_types,
    field_value,
    gguf_weights_version,
    hf_tensor_name,
    open_gguf,
    read_gguf_config,
)

__all__ = [
    "GGUFTensor",
    "UnsupportedTensorType",
    "dequantize_tensor",
    "gguf_weights_version",
    "read_gguf_config",
    "read_gguf_tensors",
    "unpermute_rows",
]

_FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@dataclasses.dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor of a GGUF file, in the file's type.

    `qtype` is a gguf.GGMLQuantizationType value. `shape` is the logical shape in torch
    order ((out, in) for a matrix, (n,) for a norm or bias). `data` is, for F32/F16/BF16,
    a tensor of that dtype and shape; for a block type, uint8 [out, row_bytes] (the file's
    blocks of each row, row_bytes = in / block_size * block_bytes); [experts, out, row_bytes]
    for a mixture of experts' stacked projections (shape (experts, out, in))."""

    qtype: int
    shape: tuple[int, ...]
    data: torch.Tensor

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.qtype).name

    @property
    def is_quantized(self) -> bool:
        return self.type_name not in _FLOAT_TYPES


def read_gguf_tensors(path: str | Path) -> dict[str, GGUFTensor]:
    """Every weight of the file by Hugging Face name, q/k rows un-permuted for a "llama" or
    "smollm3" file, a Gemma file's norms without the 1 its converter added. Raises
    UnsupportedTensorType (a ValueError naming the tensor and its type) for a type outside
    common.gguf_meta.SUPPORTED_TYPES, ValueError for an unknown tensor name."""
    reader = open_gguf(path)
    check_tensor_types(reader, path)
    config = read_gguf_config(path, reader)  # also validates the architecture
    arch = str(field_value(reader, "general.architecture"))
    permuted = arch in PERMUTED_ARCHITECTURES
    tensors: dict[str, GGUFTensor] = {}
    for entry in reader.tensors:
        if entry.name in CONFIG_TENSORS:  # already in config["rope_parameters"]
            continue
        name = hf_tensor_name(entry.name, arch)
        tensor = _to_tensor(entry)
        if permuted and ".self_attn.q_proj." in name:
            tensor = unpermute_rows(tensor, config["num_attention_heads"])
        elif permuted and ".self_attn.k_proj." in name:
            tensor = unpermute_rows(tensor, config["num_key_value_heads"])
        elif arch in GEMMA_ARCHITECTURES and name.endswith("norm.weight"):
            tensor = _minus_one(tensor)
        tensors[name] = tensor
    return tensors


def _to_tensor(entry: Any) -> GGUFTensor:
    """A reader tensor (numpy view of the map) as a GGUFTensor (torch view, no copy)."""
    type_name = entry.tensor_type.name
    shape = tuple(int(d) for d in reversed(entry.shape.tolist()))
    array = np.asarray(entry.data)
    if type_name == "BF16":  # gguf-py gives raw bytes [rows, 2 * cols]
        data = torch.from_numpy(array).view(torch.bfloat16)
    elif type_name in _FLOAT_TYPES:
        data = torch.from_numpy(array)
    else:
        # rows of blocks: [out, row_bytes], or [experts, out, row_bytes] for stacked experts
        data = torch.from_numpy(array.reshape(*(shape[:-1] if len(shape) > 1 else (1,)), -1))
    if type_name in _FLOAT_TYPES:
        data = data.reshape(shape)
    return GGUFTensor(qtype=int(entry.tensor_type), shape=shape, data=data)


def _minus_one(tensor: GGUFTensor) -> GGUFTensor:
    """A Gemma norm weight as its checkpoint holds it: float32, 1 taken off."""
    from gguf import GGMLQuantizationType

    values = dequantize_tensor(tensor) - 1.0
    return GGUFTensor(qtype=int(GGMLQuantizationType.F32), shape=tensor.shape, data=values)


def unpermute_rows(tensor: GGUFTensor, num_heads: int) -> GGUFTensor:
    """Undo llama.cpp's `permute(w, n_head, n_head_kv)` on the rows of a q or k weight or
    bias (transformers' LlamaTensorProcessor._reverse_permute_weights, on torch rows)."""
    rows = tensor.data.shape[0]
    half = rows // num_heads // 2
    rest = tensor.data.shape[1:]
    data = tensor.data.reshape(num_heads, half, 2, *rest).transpose(1, 2).reshape(rows, *rest)
    return dataclasses.replace(tensor, data=data.contiguous())


def dequantize_tensor(tensor: GGUFTensor) -> torch.Tensor:
    """The tensor as float32 in its logical shape: gguf-py's dequantisation, the reference
    every quantized kernel is checked against, and the fallback for a type with no kernel."""
    if not tensor.is_quantized:
        return tensor.data.to(torch.float32)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    values = dequantize(tensor.data.numpy(), GGMLQuantizationType(tensor.qtype))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(tensor.shape)


assert set(_FLOAT_TYPES) <= set(SUPPORTED_TYPES)
