"""Facts read from a Hugging Face model folder that several processes need (no torch).

Each function also takes a GGUF file (`--model X.gguf`): it reads the folder written from the
file's metadata (common/model_paths.tokenizer_dir), so callers pass the model path as is."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _folder(model: Path) -> Path:
    """The folder itself, or a GGUF file's tokenizer folder."""
    if Path(model).suffix.lower() != ".gguf":
        return model
    from common.model_paths import tokenizer_dir

    return tokenizer_dir(model)


def load_model_facts(model_dir: Path, max_model_len_override: int = 0) -> dict[str, Any]:
    """EOS ids, context length and vocabulary size from config.json/generation_config.json."""
    model_dir = _folder(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    gen_path = model_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    eos: set[int] = set()
    for src in (cfg.get("eos_token_id"), gen.get("eos_token_id")):
        if isinstance(src, int):
            eos.add(src)
        elif isinstance(src, list):
            eos.update(int(x) for x in src)
    max_len = int(cfg.get("max_position_embeddings", 2048))
    if max_model_len_override:
        max_len = min(max_len, max_model_len_override)
    return {
        "eos_token_ids": sorted(eos),
        "max_model_len": max_len,
        "vocab_size": int(cfg["vocab_size"]),
    }


def tokenizer_fingerprint(model_dir: Path) -> str:
    """A hash of the tokenizer files: a different tokenizer means different token ids."""
    model_dir = _folder(model_dir)
    h = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        path = model_dir / name
        if path.is_file():
            h.update(name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def position_config(model_dir: Path) -> str:
    """The rope / position settings, canonically serialised (part of the cache root)."""
    model_dir = _folder(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    keys = (
        "rope_theta",
        "rope_parameters",
        "rope_scaling",
        "max_position_embeddings",
        "partial_rotary_factor",
        "head_dim",
    )
    return json.dumps({k: cfg.get(k) for k in keys}, sort_keys=True)


def salted_root(root: int, salt: str) -> int:
    """A request's root under its `cache_salt` (vLLM's): H(root, salt), so only requests
    with the same salt share prefix blocks; no salt ("") is the root itself."""
    if not salt:
        return root
    text = f"{root}\0salt\0{salt}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def lora_root(root: int, lora_name: str, weights_hash: str) -> int:
    """A request's root under its LoRA adapter: H(root, adapter name, its weights hash), so
    two adapters never share prefix blocks and an adapter reloaded with other weights under
    the same name never hits the old ones; the base model ("") is the root itself."""
    if not lora_name:
        return root
    text = f"{root}\0lora\0{lora_name}\0{weights_hash}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def cache_root(model_id: str, weights_version: str, tokenizer_fp: str, position_cfg: str) -> int:
    """h_-1 of the prefix cache's hash chain: H(model id, weights version, tokenizer
    fingerprint, rope/position config). A new version changes every block hash."""
    text = "\0".join((model_id, weights_version, tokenizer_fp, position_cfg))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
