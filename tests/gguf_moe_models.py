"""Write tiny mixture-of-experts GGUF files for tests, in llama.cpp's layout (its
convert_hf_to_gguf.py for Qwen2MoeModel / Qwen3MoeModel / OlmoeModel): each projection's
experts stacked in one 3-D tensor `blk.{i}.ffn_{gate,up,down}_exps.weight` [experts, out, in]
of the file's block type, the router `ffn_gate_inp` and the shared expert's gate
`ffn_gate_inp_shexp` (a vector) in F32, the shared expert's projections
`ffn_{gate,up,down}_shexp`, and the expert counts and widths as `{arch}.expert_*` metadata.
Everything else as tests/gguf_models.py writes a dense file (OLMoE's whole-projection q/k
norms `attn_{q,k}_norm` as F32 vectors; no q/k permutation but Mixtral's "llama" file's).
llama.cpp's qwen2moe/qwen3moe/olmoe have experts in every layer."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file

from tests.gguf_models import _write_hparams, _write_tokenizer, encode, gguf_name, permute

# Mixtral: llama.cpp's "llama" architecture with experts (q/k rows permuted as a llama's)
MOE_GGUF_ARCHS = {
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "olmoe": "olmoe",
    "mixtral": "llama",
}
_MIXTRAL = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
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
    if cfg["model_type"] == "mixtral":  # Mixtral's names as the others'
        weights = {_unmixtral(n): w for n, w in weights.items()}
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_string("general.name", f"tiny {cfg['model_type']}")
    _write_hparams(writer, arch, cfg)
    num_experts = cfg.get("num_experts") or cfg["num_local_experts"]
    writer.add_uint32(f"{arch}.expert_count", num_experts)
    writer.add_uint32(f"{arch}.expert_used_count", cfg["num_experts_per_tok"])
    if cfg.get("moe_intermediate_size"):
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
        if arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
            heads = cfg["num_attention_heads"]
            kv = heads if ".q_proj." in hf_name else cfg["num_key_value_heads"]
            data = permute(torch.from_numpy(np.ascontiguousarray(data)), heads, kv).numpy()
        raw = None if kind in (Q.F32, Q.F16) else kind
        writer.add_tensor(name, np.ascontiguousarray(data), raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def _unmixtral(name: str) -> str:
    """Mixtral's `block_sparse_moe` names as `mlp` ones (w1/w3/w2: gate/up/down)."""
    parts = name.replace(".block_sparse_moe.", ".mlp.").split(".")
    if len(parts) > 6 and parts[4] == "experts":
        parts[6] = _MIXTRAL.get(parts[6], parts[6])
    return ".".join(parts)


def hf_folder_of(expected: dict[str, torch.Tensor], like: str | Path, folder: str | Path) -> Path:
    """A Hugging Face folder of the float weights a file stands for (write_moe_gguf's
    `expected`), with `like`'s config and tokenizer: the reference for an architecture whose
    GGUF transformers does not read (Mixtral, OLMoE). Returns the folder."""
    import shutil

    from safetensors.torch import save_file

    like, folder = Path(like), Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((like / "config.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for name, w in expected.items():
        if name.endswith("_exps"):  # stacked experts -> per expert
            prefix, proj = name.rsplit(".", 1)
            for e in range(w.shape[0]):
                tensors[f"{prefix}.{e}.{proj.removesuffix('_exps')}_proj.weight"] = w[e]
        else:
            tensors[name] = w
    if cfg["model_type"] == "mixtral":
        back = {v: k for k, v in _MIXTRAL.items()}
        renamed = {}
        for name, w in tensors.items():
            parts = name.split(".")
            if len(parts) > 4 and parts[3] == "mlp":
                parts[3] = "block_sparse_moe"
                if len(parts) > 6 and parts[4] == "experts":
                    parts[6] = back[parts[6]]
            renamed[".".join(parts)] = w
        tensors = renamed
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    for f in like.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy(f, folder / f.name)
    return folder
