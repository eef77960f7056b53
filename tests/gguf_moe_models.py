"""Write tiny mixture-of-experts GGUF files for tests, in llama.cpp's layout (its
convert_hf_to_gguf.py for Qwen2MoeModel / Qwen3MoeModel): each projection's experts stacked
in one 3-D tensor `blk.{i}.ffn_{gate,up,down}_exps.weight` [experts, out, in] of the file's
block type, the router `ffn_gate_inp` and the shared expert's gate `ffn_gate_inp_shexp` (a
vector) in F32, the shared expert's projections `ffn_{gate,up,down}_shexp`, and the expert
counts and widths as `{arch}.expert_*` metadata. Everything else as tests/gguf_models.py
writes a dense file. llama.cpp's qwen2moe/qwen3moe have experts in every layer."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file

from tests.gguf_models import _write_hparams, _write_tokenizer, encode, gguf_name

MOE_GGUF_ARCHS = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
_SHARED = {"gate_proj": "ffn_gate_shexp", "up_proj": "ffn_up_shexp", "down_proj": "ffn_down_shexp"}


def _moe_gguf_name(hf_name: str) -> str:
    parts = hf_name.split(".")  # model.layers.N.mlp.<...>.weight
    if len(parts) < 5:
        return gguf_name(hf_name)
    layer, rest = parts[2], ".".join(parts[3:-1])
    if rest == "mlp.gate":
        return f"blk.{layer}.ffn_gate_inp.weight"
    if rest == "mlp.shared_expert_gate":
        return f"blk.{layer}.ffn_gate_inp_shexp.weight"
    if rest.startswith("mlp.shared_expert."):
        return f"blk.{layer}.{_SHARED[parts[-2]]}.weight"
    return gguf_name(hf_name)


def write_moe_gguf(folder: str | Path, path: str | Path, qtype: Q) -> dict[str, torch.Tensor]:
    """Write the MoE model in `folder` to `path` with every matrix but the routers in
    `qtype`; returns the float32 weights the file stands for, by HF name."""
    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    arch = MOE_GGUF_ARCHS[cfg["model_type"]]
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(str(file)))
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_string("general.name", f"tiny {cfg['model_type']}")
    _write_hparams(writer, arch, cfg)
    num_experts = cfg.get("num_experts") or cfg["num_local_experts"]
    writer.add_uint32(f"{arch}.expert_count", num_experts)
    writer.add_uint32(f"{arch}.expert_used_count", cfg["num_experts_per_tok"])
    writer.add_uint32(f"{arch}.expert_feed_forward_length", cfg["moe_intermediate_size"])
    if cfg.get("shared_expert_intermediate_size"):
        shared = cfg["shared_expert_intermediate_size"]
        writer.add_uint32(f"{arch}.expert_shared_feed_forward_length", shared)
    _write_tokenizer(writer, folder, cfg)
    expected: dict[str, torch.Tensor] = {}
    tensors: list[tuple[str, str, torch.Tensor]] = []  # (gguf name, hf name, weight)
    for i in range(cfg["num_hidden_layers"]):
        prefix = f"model.layers.{i}.mlp.experts."
        for proj, short in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
            names = [f"{prefix}{e}.{proj}.weight" for e in range(num_experts)]
            stacked = torch.stack([weights.pop(n) for n in names])
            tensors.append((f"blk.{i}.ffn_{short}_exps.weight", f"{prefix}{short}_exps", stacked))
    tensors += [(_moe_gguf_name(n), n, w) for n, w in sorted(weights.items())]
    for seed, (name, hf_name, weight) in enumerate(tensors):
        weight = weight.float().contiguous()
        router = name.endswith(("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight"))
        kind = qtype if weight.dim() >= 2 and not router else Q.F32
        if name.endswith("ffn_gate_inp_shexp.weight"):
            weight = weight.reshape(-1)  # llama.cpp keeps the shared expert's gate a vector
        data, expected[hf_name] = encode(weight, kind, seed)
        raw = None if kind in (Q.F32, Q.F16) else kind
        writer.add_tensor(name, np.ascontiguousarray(data), raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected
