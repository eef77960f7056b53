"""What a model folder says besides its tensors: config.json, the EOS ids, the weights' version.

    read_hf_config(folder)          config.json (a GGUF file's: written from its metadata)
    eos_token_ids(folder, config)   config.json's and generation_config.json's, sorted
    weights_version(folder)         a cheap hash of the weight files, naming a loaded version
    safetensors_files(folder)       the weight files, in order

A model is a Hugging Face folder or a GGUF file (common/gguf_meta.py gives its config and
tokenizer folder); gpu_worker/model_loader/loader.py reads the tensors.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from common.gguf_meta import is_gguf_file
from gpu_worker.model_loader.gguf_file import gguf_weights_version

_MIB = 1 << 20


def read_hf_config(folder: str | Path) -> dict[str, Any]:
    """The model's config.json: a folder's, or the one written from a GGUF file's metadata."""
    if is_gguf_file(folder):
        from common.model_paths import hf_config_of  # (the config: not for tools/gpu-check)

        return hf_config_of(folder)
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json: not a Hugging Face model folder")
    return json.loads(path.read_text())


def safetensors_files(folder: str | Path) -> list[Path]:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no *.safetensors weights")
    return files


def eos_token_ids(folder: str | Path, hf_config: dict[str, Any]) -> list[int]:
    """EOS ids from config.json and generation_config.json together, sorted."""
    ids: set[int] = set()
    sources = [hf_config]
    gen_path = _tokenizer_dir(folder) / "generation_config.json"
    if gen_path.is_file():
        sources.append(json.loads(gen_path.read_text()))
    for source in sources:
        value = source.get("eos_token_id")
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    return sorted(ids)


def _tokenizer_dir(model: str | Path) -> Path:
    """The folder of a model's tokenizer and generation config (a GGUF file's is written
    from its metadata)."""
    if not is_gguf_file(model):
        return Path(model)
    from common.model_paths import tokenizer_dir  # (imports the config: not for gpu-check)

    return tokenizer_dir(model)


def weights_version(folder: str | Path) -> str:
    """16 hex chars of sha256 over each weights file's name, size, first and last MiB.

    Cheap on multi-GB checkpoints, yet any re-export or fine-tune changes it. A GGUF file:
    the same over the file.
    """
    if is_gguf_file(folder):
        return gguf_weights_version(folder)
    digest = hashlib.sha256()
    for path in safetensors_files(folder):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            digest.update(f.read(_MIB))
            f.seek(max(0, size - _MIB))
            digest.update(f.read(_MIB))
    return digest.hexdigest()[:16]
