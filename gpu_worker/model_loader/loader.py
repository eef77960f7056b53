"""Load a model into our Llama: a Hugging Face folder (*.safetensors; float, or int8
compressed-tensors, gpu_worker/model_loader/compressed_tensors.py) or a GGUF file
(gpu_worker/model_loader/gguf_file.py); what else a folder says is read by hf_folder.py.

The checkpoint's separate q/k/v and gate/up projections are concatenated into the fused
`qkv_proj` and `gate_up_proj` weights our model uses; a tied LM head reuses the embedding.
The model is built on the "meta" device and the loaded tensors are assigned to it, so the
weights are never initialised and then overwritten. `build_model` is the one owner of
placement: each linear layer moves to the model's device once its method has loaded it
(float, GGUF shards, int8 and scales alike), the other tensors as they are assigned. Under
tensor parallelism each rank reads only its slices from the files (safetensors slices,
gpu_worker/distributed/sharding.py says which).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from common.gguf_meta import is_gguf_file
from gpu_worker.attention import AttentionBackend
from gpu_worker.distributed.sharding import (
    Split,
    check_divisible,
    fused_ranges,
    shard_range,
    split_of,
    vocab_shard_size,
)
from gpu_worker.distributed.tensor_parallel import TensorParallel
from gpu_worker.layers.fused_moe import ExpertWeights, FusedMoE
from gpu_worker.layers.kernel_choice import TORCH_KERNELS, KernelChoice
from gpu_worker.layers.linear_methods.weights import GGUFShard, GGUFWeight, concat_rows
from gpu_worker.layers.moe_methods import moe_method
from gpu_worker.model_loader.compressed_tensors import (
    check_int8_w8a8,
    int8_weights,
    quantization_config,
    quantize_linear_weights,
)
from gpu_worker.model_loader.gguf_file import (
    GGUFTensor,
    dequantize_tensor,
    read_gguf_tensors,
)
from gpu_worker.model_loader.hf_folder import read_hf_config, safetensors_files
from gpu_worker.model_loader.moe_weights import fuse_expert_weights, split_stacked_experts
from gpu_worker.model_loader.mxfp4 import check_mxfp4, is_mxfp4
from gpu_worker.models import moe
from gpu_worker.models.llama import LlamaForCausalLM
from gpu_worker.models.llama_config import LlamaConfig


def fuse_weights(weights: dict[str, Any], cfg: LlamaConfig) -> dict[str, Any]:
    """HF names -> ours: q/k/v into qkv_proj, gate/up into gate_up_proj (float tensors or
    quantized weights, gpu_worker/layers/linear_methods/weights.py)."""
    out = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
    for i in range(cfg.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for kind in ("weight", "bias"):
            _concat(out, [f"{attn}{p}_proj.{kind}" for p in "qkv"], f"{attn}qkv_proj.{kind}")
            gate_up = [f"{mlp}{p}_proj.{kind}" for p in ("gate", "up")]
            _concat(out, gate_up, f"{mlp}gate_up_proj.{kind}")
            shared = [f"{mlp}shared_expert.{p}_proj.{kind}" for p in ("gate", "up")]
            _concat(out, shared, f"{mlp}shared_expert.gate_up_proj.{kind}")
    if cfg.moe is not None:
        fuse_expert_weights(out, cfg.moe, cfg.num_layers)
    return out


def _concat(weights: dict[str, Any], names: list[str], fused: str) -> None:
    if not any(n in weights for n in names):
        return
    missing = [n for n in names if n not in weights]
    if missing:
        raise KeyError(f"checkpoint has some of {names} but not {missing}")
    weights[fused] = concat_rows([weights.pop(n) for n in names])


def check_tensor_parallel(cfg: LlamaConfig, world: int, folder: str | Path = "") -> None:
    """Refuse (ValueError naming --tensor-parallel-size) a model that does not split."""
    check_divisible(
        world,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size,
        model=str(folder) or "the model",
    )
    if cfg.moe is not None:
        moe.check_tensor_parallel(cfg.moe, cfg.model_type, world, str(folder) or "the model")


def fused_parts(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """The row counts of the parts a fused checkpoint tensor stacks (Phi-3's qkv_proj and
    gate_up_proj), by layer name: how a rank finds its slices of each."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"qkv_proj": (q, kv, kv), "gate_up_proj": (cfg.intermediate_size,) * 2}


def read_weights(
    folder: str | Path, tp: TensorParallel, fused: dict[str, tuple[int, ...]] | None = None
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors (HF names), or under tensor parallelism this rank's slices
    of them: only those bytes are read. `fused`: fused_parts of the model, for a checkpoint
    that fuses q/k/v or gate/up (Phi-3)."""
    weights: dict[str, torch.Tensor] = {}
    for path in safetensors_files(folder):
        if tp.size == 1:
            weights.update(load_file(str(path), device="cpu"))
            continue
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118  # safe_open is not a mapping
                weights[name] = _read_shard(f, name, tp, fused or {})
    return weights


def _read_shard(
    f: Any, name: str, tp: TensorParallel, fused: dict[str, tuple[int, ...]]
) -> torch.Tensor:
    split = split_of(name)
    if split is Split.FUSED:  # each part's slice, stacked as the fused layer's rows
        parts = fused.get(name.split(".")[-2])
        if parts is None:
            raise ValueError(f"{name}: a fused tensor, but the model's part sizes are not known")
        sliced = f.get_slice(name)
        ranges = fused_ranges(parts, tp.rank, tp.size)
        return torch.cat([sliced[start:end] for start, end in ranges])
    if split is Split.REPLICATED:
        return f.get_tensor(name)
    if split is Split.ROW_BIAS:  # added once, after the all-reduce: rank 0 holds it
        bias = f.get_tensor(name)
        return bias if tp.is_leader else torch.zeros_like(bias)
    sliced = f.get_slice(name)
    shape = tuple(sliced.get_shape())
    start, end = shard_range(split, shape, tp.rank, tp.size)
    if split is Split.ROW:
        return sliced[:, start:end]
    if split is Split.DIM2:
        return sliced[:, :, start:end]
    part = sliced[start:end]
    if split is Split.VOCAB:  # pad the last shards to the common size with zero rows
        rows = vocab_shard_size(shape[0], tp.size)
        pad = part.new_zeros(rows - part.shape[0], *part.shape[1:])
        part = torch.cat([part, pad]) if pad.numel() else part
    return part


def load_model(
    folder: str | Path,
    backend: AttentionBackend,
    *,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    tp: TensorParallel | None = None,
    kernels: KernelChoice = TORCH_KERNELS,
    quantization: str = "",
    hf_config: dict[str, Any] | None = None,
) -> LlamaForCausalLM:
    """Build the model for `folder` on `device` in `dtype`, ready for inference (with `tp`:
    this rank's shard of it), its layer ops, linear methods and decode step from `kernels`;
    with `quantization` "int8", a float checkpoint's decoder linears quantized as it loads.
    `hf_config`: its config.json when the caller has read it already (read here otherwise)."""
    tp = tp or TensorParallel()
    hf_config = read_hf_config(folder) if hf_config is None else hf_config
    cfg = LlamaConfig.from_hf(hf_config)
    check_tensor_parallel(cfg, tp.size, folder)
    weights = fuse_weights(read_checkpoint(folder, hf_config, tp, quantization), cfg)
    return build_model(cfg, weights, backend, dtype, device, max_positions, tp, kernels)


def build_model(
    cfg: LlamaConfig,
    weights: dict[str, Any],
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    tp: TensorParallel,
    kernels: KernelChoice,
) -> LlamaForCausalLM:
    """The model built on "meta" and given `weights` (our names, fused; float tensors or
    quantized weights): each linear layer's method from `kernels` takes its weight, the
    rest is assigned; nothing is initialised and then overwritten."""
    with torch.device("meta"):
        model = LlamaForCausalLM(
            cfg, backend, max_positions=max_positions, device=device, tp=tp, ops=kernels.ops
        )
    tied = weights.pop(TIED_BLOCKS, None)
    if cfg.tie_word_embeddings or "lm_head.weight" not in weights:
        # the LM head reads the embedding's weight (a GGUF file's blocks, as they are)
        weights["lm_head.weight"] = tied if tied is not None else weights[EMBED]
    for name, layer in model.linears():
        weight = weights.pop(f"{name}.weight")
        bias = weights.pop(f"{name}.bias", None)
        layer.method = kernels.linear_method(weight)
        layer.method.load_weights(layer, _to(weight, dtype), _to(bias, dtype))
        # the one place a layer's tensors move: whatever the method made of the checkpoint's
        # (float, GGUF shards, int8 and scales) goes to the model's device before any packing
        layer.to(device)
    for name, experts in model_experts(model):
        checkpoint = weights.pop(name)
        experts.method = moe_method(kernels, checkpoint)
        experts.method.load_weights(experts, _experts_to(checkpoint, dtype))
        experts.to(device)
    # pop as we go: a dtype or device change never holds two copies of the whole model
    rest = {name: _to(weights.pop(name), dtype).to(device) for name in list(weights)}
    missing, unexpected = model.load_state_dict(rest, strict=False, assign=True)
    missing = [m for m in missing if m in _not_linear(model)]
    if missing or unexpected:
        raise KeyError(f"checkpoint does not fit the model: missing {missing}, extra {unexpected}")
    for _, layer in model.linears():
        layer.method.process_weights_after_loading(layer)
    for _, experts in model_experts(model):
        experts.method.process_weights_after_loading(experts)
    if cfg.is_llama_layout:  # the one-call step computes the Llama layer only
        model.model.one_call_step = kernels.one_call_step_for(model.model)
    return model.eval().requires_grad_(False)


def read_gguf_weights(path: str | Path) -> dict[str, Any]:
    """A GGUF file's tensors by HF name: each linear layer's block-quantized weight as it is
    stored (GGUFWeight), every other tensor (and float-typed linears) as float. The
    embedding is dequantized for lookups; a tied LM head keeps the embedding's blocks."""
    weights: dict[str, Any] = {}
    for name, tensor in read_gguf_tensors(path).items():
        experts = split_stacked_experts(name, tensor)
        if experts is not None:  # a mixture of experts' stacked projection
            weights.update(experts)
            continue
        if name == EMBED and tensor.is_quantized and "lm_head.weight" not in weights:
            weights[TIED_BLOCKS] = _gguf_weight(tensor)
        is_linear = name.endswith("_proj.weight") or name == "lm_head.weight"
        if is_linear and tensor.is_quantized:
            weights[name] = _gguf_weight(tensor)
        else:
            weights[name] = dequantize_tensor(tensor)
        if name.endswith(".shared_expert_gate.weight") and len(tensor.shape) == 1:
            weights[name] = weights[name][None]  # llama.cpp keeps it as a vector: [1, hidden]
    if "lm_head.weight" in weights:
        weights.pop(TIED_BLOCKS, None)
    return weights


def read_checkpoint(
    folder: str | Path, hf_config: dict[str, Any], tp: TensorParallel, quantization: str = ""
) -> dict[str, Any]:
    """The tensors of a GGUF file, an int8 W8A8 compressed-tensors folder or a float folder
    (this rank's slices), by HF name (`hf_config`: its config.json); with `quantization`
    "int8", a float folder's decoder linears quantized as they are read. Raises ValueError
    for a compressed-tensors scheme that is not served."""
    if is_gguf_file(folder):
        if tp.size != 1:
            raise ValueError(
                f"{folder}: a GGUF file is served on one rank (--tensor-parallel-size 1)"
            )
        return read_gguf_weights(folder)
    fused = fused_parts(LlamaConfig.from_hf(hf_config)) if tp.size > 1 else None
    if is_mxfp4(hf_config):  # gpt-oss as shipped: MXFP4 experts, the rest float
        check_mxfp4(hf_config, quantization)
        return read_weights(folder, tp, fused)
    qc = quantization_config(hf_config)
    if qc is not None:
        check_int8_w8a8(qc)  # (before the weights are read)
        return int8_weights(read_weights(folder, tp, fused))
    raw = read_weights(folder, tp, fused)
    return quantize_linear_weights(raw) if quantization == "int8" else raw


def stores_quantized(path: str | Path, hf_config: dict[str, Any], quantization: str = "") -> bool:
    """Whether the model at `path` (`hf_config`: its config.json), loaded with
    `quantization`, may have quantized linears: a GGUF file, an int8 checkpoint, or
    --quantization int8."""
    return bool(quantization) or is_gguf_file(path) or "quantization_config" in hf_config


def _gguf_weight(tensor: GGUFTensor) -> GGUFWeight:
    return GGUFWeight((GGUFShard(tensor.qtype, tensor.data),), in_features=tensor.shape[1])


EMBED = "model.embed_tokens.weight"
TIED_BLOCKS = "lm_head.tied_blocks"  # a GGUF embedding's blocks, for a tied LM head


def _to(weight: Any, dtype: torch.dtype) -> Any:
    """A float tensor in the model's dtype; quantized weights (and None) as they are. The
    device is build_model's to set, once, for every tensor."""
    if isinstance(weight, torch.Tensor) and weight.is_floating_point():
        return weight.to(dtype)
    return weight


def _not_linear(model: LlamaForCausalLM) -> set[str]:
    """The state-dict names of everything but the linear and MoE layers (which the methods
    load)."""
    layers: list[tuple[str, torch.nn.Module]] = [*model.linears(), *model_experts(model)]
    linear_params = {f"{name}.{p}" for name, layer in layers for p, _ in layer.named_parameters()}
    return set(model.state_dict()) - linear_params


def model_experts(model: torch.nn.Module) -> list[tuple[str, FusedMoE]]:
    """Every MoE layer of the model with its name, in the model's order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, FusedMoE)]


def _experts_to(experts: ExpertWeights, dtype: torch.dtype) -> ExpertWeights:
    """The checkpoint's float experts (and biases) in the model's dtype; quantized as they are."""
    return ExpertWeights(
        [_to(w, dtype) for w in experts.gate_up],
        [_to(w, dtype) for w in experts.down],
        _to(experts.gate_up_bias, dtype),
        _to(experts.down_bias, dtype),
    )
