"""What a GGUF file says about its model, read without torch (numpy and gguf-py only).

A `--model FILE.gguf` serves the file as it is. Every process other than the worker needs only
its metadata: an HF-style config (read_gguf_config), a version (gguf_weights_version) and a
tokenizer. gguf_tokenizer_folder writes those once, as a Hugging Face folder (config.json,
tokenizer files, generation_config.json), under `<cache>/gguf/<version>/`, so the tokenizer,
detokenizer and model facts read it like any model folder (common/model_paths.tokenizer_dir).
The tensors themselves are read by gpu_worker/model_loader/gguf_file.py.

Mixtures of experts: qwen2moe, qwen3moe and olmoe files (OLMoE: q/k norms over the whole
projections, `attn_q_norm` / `attn_k_norm`), and Mixtral's (a "llama" file with
`llama.expert_count`); each projection's experts are one 3-D tensor (`ffn_gate_exps`...).

Dense families: llama (Mistral is a "llama" file named so), qwen2, qwen3, phi3, smollm3,
gemma2, gemma3; what each adds to the Llama keys is read by common/gguf_families.py. Two kinds
of tensor are config, not weights (CONFIG_TENSORS): a Llama 3 rope scaling's rope_freqs, and a
Phi-3 long-context file's LongRoPE factors (rope_factors_long/short).

Names: llama.cpp's converter renames Hugging Face tensors (`model.layers.3.mlp.up_proj.weight`
-> `blk.3.ffn_up.weight`); hf_tensor_name undoes it. The converter also permutes the rows of
q and k for the "llama" and "smollm3" architectures (llama covers Mistral too); the reader
undoes that.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from common.gguf_families import GEMMA_ARCHITECTURES, family_config, phi3_rope_config

if TYPE_CHECKING:
    from gguf import GGUFReader

_MIB = 1 << 20
# mixture-of-experts architectures (llama.cpp's names) -> model_type
MOE_ARCHITECTURES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "olmoe": "olmoe"}
# model types whose GGUF config transformers does not read (its tokenizer is given ours)
UNREAD_BY_TRANSFORMERS = frozenset({"olmoe", "smollm3"})  # (transformers 5 reads neither)
MARKER = "shuttle_gguf"  # config.json entry of a GGUF's tokenizer folder: {"path": file}
# general.architecture -> model_type; a "llama" file named like Mistral is a mistral
ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "smollm3": "smollm3",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
    **MOE_ARCHITECTURES,
}
# the llama.cpp converter permutes q/k rows (rotary pairs) only for these
PERMUTED_ARCHITECTURES = frozenset({"llama", "smollm3"})
# ggml type names we serve: float types as tensors, block types as raw bytes
SUPPORTED_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)
ROPE_FREQS = "rope_freqs.weight"  # Llama 3 rope scaling as factors: read into the config
# Phi-3's LongRoPE factors (long- and short-context variants): read into the config
ROPE_FACTORS = {
    "rope_factors_long.weight": "long_factor",
    "rope_factors_short.weight": "short_factor",
}
CONFIG_TENSORS = frozenset({ROPE_FREQS, *ROPE_FACTORS})  # no model weight: the config's

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",  # phi3's fused q/k/v
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # mixture of experts: the router, each projection's experts stacked in one 3-D tensor
    # [experts, out, in] (split per expert by the worker's reader), the shared expert
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_exps",
    "ffn_up_exps": "mlp.experts.up_exps",
    "ffn_down_exps": "mlp.experts.down_exps",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Gemma's four norms a layer: its ffn_norm is the norm before the MLP, not after attention
_GEMMA_LAYER_NAMES = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


class UnsupportedTensorType(ValueError):
    """A tensor stored in a ggml type shuttle does not serve (e.g. Q2_K, IQ2_XXS)."""

    def __init__(self, gguf_name: str, hf_name: str, type_name: str, path: str | Path) -> None:
        super().__init__(
            f"{path}: tensor {gguf_name} ({hf_name}) is stored as {type_name}, which shuttle "
            f"does not serve; supported: {', '.join(SUPPORTED_TYPES)}"
        )
        self.gguf_name, self.hf_name, self.type_name = gguf_name, hf_name, type_name


def is_gguf_file(model: str | Path) -> bool:
    """`--model X.gguf` naming a file."""
    path = Path(model).expanduser()
    return path.suffix.lower() == ".gguf" and path.is_file()


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    """llama.cpp's tensor name -> the Hugging Face one; ValueError for a name we do not know.
    A phi3 file's ffn_up is Phi-3's fused gate_up_proj (gate rows, then up rows)."""
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES and kind == "weight":
        return f"{_GLOBAL_NAMES[stem]}.weight"
    match = _LAYER_RE.match(gguf_name)
    names = (
        dict(_LAYER_NAMES, **_GEMMA_LAYER_NAMES) if arch in GEMMA_ARCHITECTURES else _LAYER_NAMES
    )
    if match and match.group(2) in names:
        layer, part, kind = match.groups()
        hf = "mlp.gate_up_proj" if arch == "phi3" and part == "ffn_up" else names[part]
        return f"model.layers.{layer}.{hf}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no place in a Llama-family model")


def open_gguf(path: str | Path) -> GGUFReader:
    """A reader over a copy-on-write memory map: tensors view the file's pages (no copy)
    and are writable for torch.from_numpy without touching the file."""
    from gguf import GGUFReader

    return GGUFReader(path, mode="c")


def field_value(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """A metadata value (scalar, string or list), or `default` when the file lacks it."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def check_tensor_types(reader: GGUFReader, path: str | Path) -> None:
    """Raise UnsupportedTensorType for the first tensor in a type we do not serve."""
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in SUPPORTED_TYPES:
            arch = str(field_value(reader, "general.architecture", ""))
            known = tensor.name not in CONFIG_TENSORS
            hf = hf_tensor_name(tensor.name, arch) if known else "rope scaling"
            raise UnsupportedTensorType(tensor.name, hf, tensor.tensor_type.name, path)


def read_gguf_config(path: str | Path, reader: GGUFReader | None = None) -> dict[str, Any]:
    """An HF-style config.json dict for the file (LlamaConfig.from_hf takes it unchanged)."""
    reader = reader or open_gguf(path)
    arch = str(field_value(reader, "general.architecture", ""))
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not one of {list(ARCHITECTURES)}")
    name = str(field_value(reader, "general.name", ""))
    model_type = "mistral" if arch == "llama" and "mistral" in name.lower() else ARCHITECTURES[arch]
    if arch == "llama" and field_value(reader, "llama.expert_count"):
        model_type = "mixtral"  # llama.cpp writes Mixtral as a llama with experts

    def value(suffix: str, default: Any) -> Any:
        return field_value(reader, f"{arch}.{suffix}", default)

    def key(suffix: str, default: Any = None) -> Any:
        value = field_value(reader, f"{arch}.{suffix}", default)
        if value is None:
            raise ValueError(f"{path}: GGUF metadata {arch}.{suffix} is missing")
        return value

    scaling = field_value(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none", "linear"):
        raise ValueError(
            f"{path}: rope scaling {scaling!r} is not supported (default, linear, llama3)"
        )
    names = {t.name: t for t in reader.tensors}
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    # (a phi3 file's rope.dimension_count is its rotated dims: Phi-4-mini's 96 of 128)
    rotary = hidden // heads if arch == "phi3" else key("rope.dimension_count", hidden // heads)
    head_dim = int(key("attention.key_length", rotary))
    theta = float(key("rope.freq_base", 10000.0))
    # (Gemma's converter writes no vocab_size: the embedding's rows are the vocabulary)
    vocab = key("vocab_size", _embedding_rows(names) or None)
    config: dict[str, Any] = {
        "architectures": [_HF_CLASSES[model_type]],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "rope_parameters": {"rope_theta": theta, "rope_type": "default"},
        "max_position_embeddings": int(key("context_length")),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_output.bias" in names,
        "mlp_bias": "blk.0.ffn_down.bias" in names,
        "hidden_act": "silu",
    }
    if scaling == "linear":
        factor = float(key("rope.scaling.factor"))
        config["rope_parameters"] = {"rope_theta": theta, "rope_type": "linear", "factor": factor}
    config.update(family_config(arch, model_type, value, config))
    if arch == "phi3":
        config.update(phi3_rope_config(value, config, _rope_factors(names, path)))
    if arch in MOE_ARCHITECTURES:
        config.update(_moe_config(reader, arch, config["num_hidden_layers"], names))
    if model_type == "mixtral":  # every layer sparse, experts of feed_forward_length
        config["num_local_experts"] = int(key("expert_count"))
        config["num_experts_per_tok"] = int(key("expert_used_count"))
        config["sliding_window"] = None
    if ROPE_FREQS in names:
        factors = np.asarray(names[ROPE_FREQS].data, dtype=np.float64)
        config["rope_parameters"] = llama3_rope_parameters(factors, theta, head_dim, path)
    for field in ("bos", "eos", "padding", "unknown"):
        token_id = field_value(reader, f"tokenizer.ggml.{field}_token_id")
        if token_id is not None:
            config[f"{_TOKEN_KEYS[field]}_token_id"] = int(token_id)
    return config


def _rope_factors(names: dict[str, Any], path: str | Path) -> dict[str, list[float]] | None:
    """A phi3 file's LongRoPE factors by config name (both tensors, or None for neither)."""
    present = [name for name in ROPE_FACTORS if name in names]
    if not present:
        return None
    if len(present) != len(ROPE_FACTORS):
        raise ValueError(f"{path}: {present[0]} without its pair {sorted(ROPE_FACTORS)}")
    return {
        ROPE_FACTORS[name]: np.asarray(names[name].data, dtype=np.float32).tolist()
        for name in ROPE_FACTORS
    }


def _embedding_rows(names: dict[str, Any]) -> int:
    embedding = names.get("token_embd.weight")
    return 0 if embedding is None else int(embedding.shape[-1])  # (ggml order: rows last)


def _moe_config(
    reader: GGUFReader, arch: str, num_layers: int, names: dict[str, Any]
) -> dict[str, Any]:
    """A MoE file's expert fields as config.json names them. llama.cpp renormalises the top-k
    weights for qwen3moe and not for qwen2moe or olmoe; a layer without a router is dense.
    OLMoE's experts are `feed_forward_length` wide (no expert_feed_forward_length: 0, which
    MoeConfig reads as intermediate_size)."""
    experts = field_value(reader, f"{arch}.expert_count")
    if experts is None:
        raise ValueError(f"GGUF metadata {arch}.expert_count is missing")
    dense = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in names]
    config: dict[str, Any] = {
        "num_experts": int(experts),
        "num_experts_per_tok": int(field_value(reader, f"{arch}.expert_used_count", 0)),
        "moe_intermediate_size": int(field_value(reader, f"{arch}.expert_feed_forward_length", 0)),
        "norm_topk_prob": arch == "qwen3moe",
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
    }
    shared = field_value(reader, f"{arch}.expert_shared_feed_forward_length")
    if shared is not None:
        config["shared_expert_intermediate_size"] = int(shared)
    return config


_HF_CLASSES = {
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
_TOKEN_KEYS = {"bos": "bos", "eos": "eos", "padding": "pad", "unknown": "unk"}


def llama3_rope_factors(
    theta: float, head_dim: int, factor: float, low: float, high: float, old_context: int
) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter writes as rope_freqs.weight for a
    Llama 3 rope scaling (its generate_extra_tensors), float64 [head_dim // 2]."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    wavelen = 2 * math.pi / freqs.astype(np.float64)
    smooth = (old_context / wavelen - low) / (high - low)
    middle = 1 / ((1 - smooth) / factor + smooth)
    return np.where(
        wavelen < old_context / high, 1.0, np.where(wavelen > old_context / low, factor, middle)
    )


def llama3_rope_parameters(
    factors: np.ndarray, theta: float, head_dim: int, path: str | Path
) -> dict[str, Any]:
    """The Llama 3 rope_parameters whose factors are `factors` (rope_freqs.weight): the file
    keeps only the factors, so we find (factor, low, high, original context) among the
    values Llama 3.x uses and check they reproduce every factor."""
    factor = float(factors.max())
    for low in (1.0, 2.0):
        for high in (4.0, 8.0, 2.0):
            for log2_context in range(4, 21):
                old = 1 << log2_context
                expected = llama3_rope_factors(theta, head_dim, factor, low, high, old)
                if np.allclose(expected, factors, rtol=1e-5, atol=0):
                    return {
                        "rope_theta": theta,
                        "rope_type": "llama3",
                        "factor": factor,
                        "low_freq_factor": low,
                        "high_freq_factor": high,
                        "original_max_position_embeddings": old,
                    }
    raise ValueError(f"{path}: {ROPE_FREQS} matches no Llama 3 rope scaling")


def gguf_weights_version(path: str | Path) -> str:
    """16 hex chars of sha256 over the file's name, size, first and last MiB (as
    gpu_worker/model_loader/hf_folder.weights_version does for a folder's safetensors)."""
    path = Path(path)
    size = path.stat().st_size
    digest = hashlib.sha256(f"{path.name}:{size}".encode())
    with path.open("rb") as f:
        digest.update(f.read(_MIB))
        f.seek(max(0, size - _MIB))
        digest.update(f.read(_MIB))
    return digest.hexdigest()[:16]


def gguf_tokenizer_folder(path: str | Path) -> Path:
    """The Hugging Face folder (config.json with a MARKER entry naming the file, tokenizer
    files with the chat template, generation_config.json) of a GGUF file, written once
    under `<cache>/gguf/<version>/`. Raises ValueError (UnsupportedTensorType among them)
    for a file we cannot serve."""
    from common.prepare_model import _write_folder, cache_root

    path = Path(path).expanduser().resolve()
    folder = cache_root() / "gguf" / gguf_weights_version(path)
    config_path = folder / "config.json"
    if config_path.is_file() and (folder / "tokenizer.json").is_file():
        if json.loads(config_path.read_text()).get(MARKER, {}).get("path") == str(path):
            return folder
    reader = open_gguf(path)
    check_tensor_types(reader, path)
    config = read_gguf_config(path, reader)
    config[MARKER] = {"path": str(path)}
    return _write_folder(folder, lambda tmp: _fill_tokenizer_folder(tmp, path, reader, config))


def _fill_tokenizer_folder(
    tmp: Path, path: Path, reader: GGUFReader, config: dict[str, Any]
) -> None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    # AutoTokenizer reads the file's config first; where transformers reads none, the fast
    # tokenizer class reads the file's tokenizer alone
    auto = config["model_type"] not in UNREAD_BY_TRANSFORMERS
    tokenizer = (AutoTokenizer if auto else PreTrainedTokenizerFast).from_pretrained(
        path.parent, gguf_file=path.name
    )
    tokenizer.save_pretrained(tmp)
    eos = [config["eos_token_id"]] if "eos_token_id" in config else []
    eot = field_value(reader, "tokenizer.ggml.eot_token_id")
    if eot is not None and int(eot) not in eos:  # llama.cpp ends generation on it too
        eos.append(int(eot))
    generation: dict[str, Any] = {
        k: config[k] for k in ("bos_token_id", "pad_token_id") if k in config
    }
    if eos:
        generation["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
