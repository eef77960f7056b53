"""A mixture-of-experts checkpoint's expert tensors, gathered per layer for FusedMoE.

Hugging Face folders name each expert's projections separately:

    model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight         Qwen-MoE, OLMoE
    model.layers.{i}.block_sparse_moe.experts.{e}.{w1,w3,w2}.weight     Mixtral
    model.layers.{i}.block_sparse_moe.gate.weight                       Mixtral's router
    model.layers.{i}.mlp.experts.{gate_up,down}_proj[_bias]             gpt-oss (stacked)
    model.layers.{i}.mlp.router.{weight,bias}                           gpt-oss's router

gpt-oss stacks each projection's experts as x @ W: gate_up_proj [E, hidden, 2 * width] with
gate and up in alternate columns (FusedMoE's "swiglu_clamp" reads them so: the layout is kept)
and down_proj [E, width, hidden]; each expert's slice is transposed to [out, in], the biases
[E, out] kept beside. Its router becomes `mlp.gate`. MXFP4 checkpoints (the shipped
gpt-oss) store the same projections as `{gate_up,down}_proj_blocks` / `_scales`:
gpu_worker/model_loader/mxfp4.py reads them.

`fuse_expert_weights` renames Mixtral's to the first form (w1 gate, w3 up, w2 down), then
replaces a sparse layer's expert tensors by one `ExpertWeights` under
`model.layers.{i}.mlp.experts` (each expert's gate and up rows fused, float or quantized
alike, gpu_worker/layers/linear_methods/weights.py); the router (`mlp.gate.weight`) and a
shared expert (`mlp.shared_expert.{gate,up,down}_proj`, fused like a dense MLP) stay linears.
Under tensor parallelism each expert tensor is already this rank's slice (the per-expert
names shard like a dense MLP's, gpu_worker/distributed/sharding.py).

A GGUF file stacks each projection's experts in one 3-D tensor (llama.cpp's
`blk.{i}.ffn_{gate,up,down}_exps`, read as `model.layers.{i}.mlp.experts.{gate,up,down}_exps`);
`split_stacked_experts` views it as the per-expert names above, each expert's blocks as the
file stores them (a view of its rows: no copy until the layer stacks them).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from gpu_worker.layers.fused_moe import ExpertWeights
from gpu_worker.layers.linear_methods.weights import (
    CheckpointWeight,
    GGUFShard,
    GGUFWeight,
    concat_rows,
)
from gpu_worker.model_loader.gguf_file import GGUFTensor
from gpu_worker.models.moe import MoeConfig

_MIXTRAL = re.compile(r"^(model\.layers\.\d+\.)block_sparse_moe\.")
_MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _rename(name: str) -> str:
    match = _MIXTRAL.match(name)
    if match is None:
        return name
    rest = name[match.end() :].split(".")
    if rest[0] == "experts" and len(rest) >= 3:
        rest[2] = _MIXTRAL_EXPERT.get(rest[2], rest[2])
    return f"{match.group(1)}mlp." + ".".join(rest)


def fuse_expert_weights(weights: dict[str, Any], moe: MoeConfig, num_layers: int) -> None:
    """In place: each sparse layer's experts as one ExpertWeights (see the module docstring).
    Raises KeyError naming an expert tensor the checkpoint lacks."""
    for name in [n for n in weights if _MIXTRAL.match(n)]:
        weights[_rename(name)] = weights.pop(name)
    for name in [n for n in weights if ".mlp.router." in n]:  # gpt-oss
        weights[name.replace(".mlp.router.", ".mlp.gate.")] = weights.pop(name)
    for i in range(num_layers):
        if not moe.is_sparse(i):
            continue
        prefix = f"model.layers.{i}.mlp.experts."
        if f"{prefix}gate_up_proj" in weights or f"{prefix}gate_up_proj_blocks" in weights:
            weights[prefix.rstrip(".")] = _stacked_experts(weights, prefix)
            continue
        gate_up, down = [], []
        for e in range(moe.num_experts):
            names = [f"{prefix}{e}.{p}_proj.weight" for p in ("gate", "up", "down")]
            missing = [n for n in names if n not in weights]
            if missing:
                raise KeyError(f"checkpoint has no {missing[0]} (expert {e} of {moe.num_experts})")
            gate_up.append(concat_rows([weights.pop(names[0]), weights.pop(names[1])]))
            down.append(weights.pop(names[2]))
        weights[prefix.rstrip(".")] = ExpertWeights(gate_up, down)


def _stacked_experts(weights: dict[str, Any], prefix: str) -> ExpertWeights:
    """gpt-oss's stacked experts under `prefix` (popped from `weights`): float [E, in, out]
    as per-expert [out, in] tensors, or MXFP4 blocks as per-expert MXFP4Weight."""
    biases = [weights.pop(f"{prefix}{p}_proj_bias", None) for p in ("gate_up", "down")]
    gate_up: list[CheckpointWeight]
    down: list[CheckpointWeight]
    if f"{prefix}gate_up_proj_blocks" in weights:
        from gpu_worker.model_loader.mxfp4 import split_mxfp4_experts

        gate_up = list(split_mxfp4_experts(weights, f"{prefix}gate_up_proj"))
        down = list(split_mxfp4_experts(weights, f"{prefix}down_proj"))
    else:
        for p in ("gate_up", "down"):
            if f"{prefix}{p}_proj" not in weights:
                raise KeyError(f"checkpoint has no {prefix}{p}_proj")
        gate_up = [w.t().contiguous() for w in weights.pop(f"{prefix}gate_up_proj")]
        down = [w.t().contiguous() for w in weights.pop(f"{prefix}down_proj")]
    return ExpertWeights(gate_up, down, *biases)


_STACKED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate|up|down)_exps\.weight$")


def split_stacked_experts(name: str, tensor: GGUFTensor) -> dict[str, Any] | None:
    """A GGUF file's stacked experts `name` [experts, out, in] as per-expert weights by HF
    name (GGUF blocks as stored, a float type as float32); None for any other tensor."""
    match = _STACKED.match(name)
    if match is None:
        return None
    prefix, proj = match.groups()
    if len(tensor.shape) != 3:
        raise ValueError(f"{name}: stacked experts must be 3-D, got shape {tensor.shape}")
    out: dict[str, Any] = {}
    for e in range(tensor.shape[0]):
        part: Any = (
            GGUFWeight((GGUFShard(tensor.qtype, tensor.data[e]),), tensor.shape[2])
            if tensor.is_quantized
            else tensor.data[e].to(torch.float32)
        )
        out[f"{prefix}.{e}.{proj}_proj.weight"] = part
    return out
