"""Tiny randomly initialised Llama-family models, saved as Hugging Face folders for tests.

Each is a few MB (hidden 64, 2 layers) with SmolLM2's vocabulary size, and SmolLM2's tokenizer
files copied in when the default model folder exists, so a tiny model can also be served end
to end. Creation is deterministic (torch.manual_seed). The shapes vary on purpose:

    llama    4 heads / 2 KV heads, untied LM head, llama3 rope scaling
    qwen2    4 heads / 1 KV head, q/k/v biases, untied
    qwen3    4 heads / 2 KV heads, head_dim 32 != hidden / heads, q/k norms, tied embeddings
    mistral  4 heads / 4 KV heads (no GQA), tied embeddings
    mistral-window   mistral with a sliding window of 16 in every layer
    qwen2-window     qwen2 whose layers from the second on slide over 8 positions
                     (use_sliding_window, max_window_layers 1)
    qwen3-yarn       qwen3 with YaRN rope scaling (factor 4 over an original 32 positions)
    llama-linear     llama with linear rope scaling (factor 2)
    phi3             Phi-3-mini's config (fused qkv/gate_up weights, no biases, untied, a
                     sliding window of about half the context: 2047 of 4096 there, 15 here)
    phi3-longrope    Phi-3-mini-128k's / Phi-3.5-mini's (longrope: short and long factors over
                     an original 32 positions of max_position_embeddings 128 here, 4096 of
                     131072 there; no window to speak of: 262144 there, none here)
    phi4-mini        Phi-4-mini's (phi3 with longrope and partial_rotary_factor 0.75: head_dim
                     16 here, 12 dims rotate; 128 there, 96 rotate; GQA, tied)
    gemma2           Gemma 2's config (4 layers alternating sliding 16 / full, head_dim 32
                     != hidden / heads, query_pre_attn_scalar 24 != head_dim as in 27b,
                     attention and final soft caps 50 and 30, tied)
    smollm3          SmolLM3's config (every 4th layer without rope: 8 layers here, 36 there;
                     GQA 4:1, tied)
    gemma3           Gemma 3 text's (6 layers: 5 sliding over 16 with a local rope base of
                     1e4, 1 full with theta 1e6 and the 4b+ linear rope scaling 8, q/k norms)
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from common.prepare_model import default_model_dir

TINY_ARCHS = (
    *("llama", "qwen2", "qwen3", "mistral"),
    *("mistral-window", "qwen2-window", "qwen3-yarn", "llama-linear", "phi3"),
    *("gemma2", "gemma3", "smollm3", "phi3-longrope", "phi4-mini"),
)
LONGROPE_ORIGINAL = 32  # the tiny longrope models' original_max_position_embeddings
# their tokens equal transformers' only where a sequence stays on one side of the original
# length for the served context (gpu_worker/models/rope.py): tests/integration/
# test_longrope_parity.py serves them so, the generic parity sweeps leave them out
LONGROPE_ARCHS = ("phi3-longrope", "phi4-mini")
VOCAB_SIZE = 49152  # SmolLM2's tokenizer
EOS_TOKEN_ID = 2  # "<|im_end|>" in SmolLM2's tokenizer
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=160,
    num_attention_heads=4,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    # larger than HF's 0.02 so a random model's logits are not all near-ties
    initializer_range=0.08,
    bos_token_id=1,
    eos_token_id=EOS_TOKEN_ID,
    pad_token_id=EOS_TOKEN_ID,
)


def _config(arch: str, num_layers: int, vocab_size: int = VOCAB_SIZE) -> Any:
    import transformers

    common = dict(_COMMON, num_hidden_layers=num_layers, vocab_size=vocab_size)
    if arch == "llama":
        llama3 = dict(
            rope_type="llama3",
            rope_theta=10000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        )
        return transformers.LlamaConfig(
            **common, num_key_value_heads=2, rope_parameters=llama3, tie_word_embeddings=False
        )
    if arch == "qwen2":
        return transformers.Qwen2Config(
            **common, num_key_value_heads=1, tie_word_embeddings=False, use_sliding_window=False
        )
    if arch == "qwen3":
        return transformers.Qwen3Config(
            **common, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True
        )
    if arch == "mistral":
        return transformers.MistralConfig(
            **common, num_key_value_heads=4, sliding_window=None, tie_word_embeddings=True
        )
    if arch == "mistral-window":
        return transformers.MistralConfig(
            **common, num_key_value_heads=2, sliding_window=16, tie_word_embeddings=True
        )
    if arch == "qwen3-yarn":
        yarn = dict(
            rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32
        )
        return transformers.Qwen3Config(
            **common, num_key_value_heads=2, head_dim=32, rope_parameters=yarn
        )
    if arch == "llama-linear":
        linear = dict(rope_type="linear", rope_theta=10000.0, factor=2.0)
        return transformers.LlamaConfig(
            **common, num_key_value_heads=2, rope_parameters=linear, tie_word_embeddings=False
        )
    if arch == "gemma2":
        return transformers.Gemma2Config(
            **dict(common, num_hidden_layers=max(num_layers, 4)),
            num_key_value_heads=2,
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=16,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            tie_word_embeddings=True,
        )
    if arch == "gemma3":
        ropes = {
            "full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1_000_000.0),
            "sliding_attention": dict(rope_type="default", rope_theta=10_000.0),
        }
        return transformers.Gemma3TextConfig(
            **dict(common, num_hidden_layers=max(num_layers, 6)),
            num_key_value_heads=1,
            head_dim=32,
            query_pre_attn_scalar=32,
            sliding_window=16,
            rope_parameters=ropes,
            tie_word_embeddings=True,
        )
    if arch == "smollm3":
        return transformers.SmolLM3Config(
            **dict(common, num_hidden_layers=max(num_layers, 8)),
            num_key_value_heads=1,
            no_rope_layer_interval=4,
            rope_parameters=dict(rope_type="default", rope_theta=5_000_000.0),
            tie_word_embeddings=True,
        )
    if arch == "phi3":
        return transformers.Phi3Config(
            **common,
            num_key_value_heads=4,
            sliding_window=15,
            tie_word_embeddings=False,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        )
    if arch in ("phi3-longrope", "phi4-mini"):
        return _phi3_longrope_config(arch, common)
    if arch == "qwen2-window":
        return transformers.Qwen2Config(
            **common,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=1,
        )
    raise ValueError(f"unknown tiny arch {arch!r}; known: {TINY_ARCHS}")


def _phi3_longrope_config(arch: str, common: dict[str, Any]) -> Any:
    """Phi-3-mini-128k's or Phi-4-mini's rope with the sizes shrunk: factors that differ per
    pair (the real ones run 1.0 .. ~1.2 short, 1 .. ~60 long), so short and long tables differ."""
    import transformers

    partial = 0.75 if arch == "phi4-mini" else 1.0
    pairs = int(common["hidden_size"] // common["num_attention_heads"] * partial) // 2
    short = [1.0 + 0.05 * i for i in range(pairs)]
    long = [1.0 + 1.5 * i * i for i in range(pairs)]
    # partial_rotary_factor in the rope parameters, where transformers 5 keeps it (Phi-4-mini's
    # config.json has it at the top level: tests/unit/gpu_worker/models/test_rope.py reads that)
    rope = dict(
        rope_type="longrope",
        rope_theta=10000.0,
        short_factor=short,
        long_factor=long,
        partial_rotary_factor=partial,
    )
    return transformers.Phi3Config(
        **dict(common, max_position_embeddings=128),
        num_key_value_heads=4 if arch == "phi3-longrope" else 2,
        sliding_window=None,
        tie_word_embeddings=arch == "phi4-mini",
        original_max_position_embeddings=LONGROPE_ORIGINAL,
        rope_parameters=rope,
    )


def _perturb_norms_and_biases(model: torch.nn.Module) -> None:
    """HF initialises norms to 1 and biases to 0; random values make loading bugs visible."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn_like(param))


def make_tiny_model(
    folder: str | Path,
    arch: str = "llama",
    *,
    num_layers: int = 2,
    seed: int = 0,
    vocab_size: int = VOCAB_SIZE,
) -> Path:
    """Create (or reuse, if complete) a tiny `arch` model in `folder`; returns the folder.
    With another `vocab_size` (a few tokens, for statistical tests) it has no tokenizer."""
    import transformers

    folder = Path(folder)
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return folder
    config = _config(arch, num_layers, vocab_size)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb_norms_and_biases(model)
    model.save_pretrained(folder)
    if vocab_size == VOCAB_SIZE:
        _copy_tokenizer(folder)
    return folder


def _copy_tokenizer(folder: Path) -> None:
    source = default_model_dir()
    for name in _TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)


# A vocabulary of its own ------------------------------------------------------------------
# The models above share SmolLM2's tokenizer. These have a byte-level BPE trained here, so
# serving one after SmolLM2 (or after another of them) changes the tokenizer: the same text
# becomes other token ids.

OWN_VOCAB_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
OWN_VOCAB_EOS_ID = 2  # "<|im_end|>"
OWN_VOCAB_CORPUS = (
    "The quick brown fox jumps over the lazy dog and runs into the forest.",
    "Request 1: the quick brown fox jumps over the lazy dog and then sleeps.",
    "Hello world, hello there! How are you today? I am fine, thank you.",
    "A model with a vocabulary of its own tokenises the same text differently.",
    "Once upon a time there was a small model that served requests all day long.",
    "def add(a, b):\n    return a + b  # numbers 12345 67890\n",
    "Le café est très chaud. Grüße aus München. 你好，世界！ 🎉🚀",
)
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def make_own_vocab_tokenizer(
    folder: str | Path,
    *,
    vocab_size: int = 600,
    corpus: tuple[str, ...] = OWN_VOCAB_CORPUS,
    added_tokens: tuple[str, ...] = (),
) -> Path:
    """Train a byte-level BPE of about `vocab_size` tokens on `corpus` (deterministic) and
    write it as a Hugging Face tokenizer: tokenizer.json, tokenizer_config.json and a ChatML
    chat_template.jinja, with OWN_VOCAB_SPECIALS as ids 0, 1, 2, and `added_tokens` (plain,
    not special: "<think>", say) last. Returns the folder."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(OWN_VOCAB_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus), trainer=trainer)
    if added_tokens:
        from tokenizers import AddedToken

        tok.add_tokens([AddedToken(t, normalized=False) for t in added_tokens])
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": OWN_VOCAB_SPECIALS[OWN_VOCAB_EOS_ID],
        "pad_token": OWN_VOCAB_SPECIALS[0],
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (folder / "chat_template.jinja").write_text(CHATML_TEMPLATE)
    return folder


def make_tiny_model_own_vocab(
    folder: str | Path,
    *,
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    vocab_size: int = 600,
    added_tokens: tuple[str, ...] = (),
) -> Path:
    """A tiny random Llama whose tokenizer is its own (make_own_vocab_tokenizer, with
    `added_tokens`); its
    embedding has exactly the tokenizer's rows. Give it the KV layout (layers, KV heads, head
    dim) of the model it is swapped with to swap in `overlap` mode (SmolLM2-135M: 30, 3, 64;
    hidden_size must be a multiple of num_heads). Created once, reused if complete."""
    import transformers
    from tokenizers import Tokenizer

    folder = Path(folder)
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return folder
    make_own_vocab_tokenizer(folder, vocab_size=vocab_size, added_tokens=added_tokens)
    num_tokens = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size()
    common = dict(
        _COMMON,
        vocab_size=num_tokens,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        bos_token_id=None,
        eos_token_id=OWN_VOCAB_EOS_ID,
        pad_token_id=0,
    )
    config = transformers.LlamaConfig(
        **common, num_key_value_heads=num_kv_heads, head_dim=head_dim, tie_word_embeddings=False
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb_norms_and_biases(model)
    model.save_pretrained(folder)
    return folder
