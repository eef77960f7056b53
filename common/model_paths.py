"""Which folder a `--model` value serves from: a Hugging Face folder, the default model, or a
synthetic spec. Folder logic only (no torch): the supervisor resolves the folder before any
process starts, and the worker resolves it the same way.

    --model /path/to/hf-folder        that folder (it must hold config.json)
    --model /path/to/file.gguf        that file, served as it is; its tokenizer and config
                                      come from a folder written once from its metadata
                                      (tokenizer_dir, common/gguf_meta.py)
    --model ""                        the default model, converted once (common/prepare_model.py)
    --model default-gguf              the default model's Q4_1 GGUF file, served as it is
    --model synthetic[:key=value,...] a folder beside the default model's

A synthetic spec resolves to `<cache>/models/synthetic[-key-value...]`, holding the default
model's tokenizer files (symlinks) and its config.json plus a `shuttle_synthetic` entry with
the parameters. The tokenizer and detokenizer read that folder as any other; the worker sees
the entry and runs its synthetic runner, which computes nothing. Parameters:

    delay_ms     sleep this long per step (0): a stand-in for a model's step time
    num_blocks   KV blocks reported to the scheduler (65536; no memory is held)
    words        how many distinct word tokens the outputs cycle through (256)
    eos_after    emit EOS as the n-th output token (0: never; ignore_eos skips it)
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from common.config import Config, ConfigError
from common.prepare_model import cache_root, prepare_default_model

PREFIX = "synthetic"
MARKER = "shuttle_synthetic"
DEFAULTS: dict[str, float] = {"delay_ms": 0.0, "num_blocks": 65536, "words": 256, "eos_after": 0}
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
    "special_tokens_map.json",
)


# --model default-gguf: the default model's own Q4_1 file, served as it is
DEFAULT_GGUF = "default-gguf"


def resolve_model_path(config: Config) -> Path:
    """The configured folder, or the default model (converted on first use)."""
    if is_synthetic_spec(config.model.model):  # the default model's tokenizer, no weights
        return prepare_synthetic_folder(config.model.model)
    if config.model.model == DEFAULT_GGUF:
        from common.prepare_model import default_gguf_path

        return _checked_gguf(default_gguf_path())
    if config.model.model:
        path = Path(config.model.model).expanduser()
        if path.suffix.lower() == ".gguf":
            return _checked_gguf(path)
        if not (path / "config.json").is_file():
            raise ConfigError(f"--model {path}: no config.json there (a Hugging Face folder?)")
        return path
    return prepare_default_model()


def _checked_gguf(path: Path) -> Path:
    """The GGUF file, its tokenizer folder written now (once) so that a file we cannot
    serve (architecture, tensor type) stops the start here, not in a child."""
    from common.gguf_meta import gguf_tokenizer_folder

    if not path.is_file():
        raise ConfigError(f"--model {path}: no such GGUF file")
    try:
        gguf_tokenizer_folder(path)
    except ValueError as e:
        raise ConfigError(f"--model {path}: {e}") from e
    return path.resolve()


def tokenizer_dir(model: str | Path) -> Path:
    """The Hugging Face folder holding the model's config.json, tokenizer files and
    generation_config.json: the model folder itself, or for a GGUF file the folder written
    from its metadata (created on first use, then cached)."""
    from common.gguf_meta import gguf_tokenizer_folder, is_gguf_file

    return gguf_tokenizer_folder(model) if is_gguf_file(model) else Path(model)


def hf_config_of(model: str | Path) -> dict[str, Any]:
    """The model's config.json as a dict, for a folder or a GGUF file alike."""
    path = tokenizer_dir(model) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model} has no config.json: not a Hugging Face model folder")
    config: dict[str, Any] = json.loads(path.read_text())
    return config


def model_display_name(path: Path) -> str:
    """A folder's name, or a GGUF file's name without .gguf."""
    return path.stem if path.suffix.lower() == ".gguf" and path.is_file() else path.name


def served_model_name(config: Config) -> str:
    """The name responses report: the first --served-model-name, else the model's name."""
    names = config.model.served_model_names
    return names[0] if names else model_display_name(resolve_model_path(config))


def is_synthetic_spec(model: str) -> bool:
    """`--model synthetic` or `--model synthetic:k=v,...`."""
    return model == PREFIX or model.startswith(PREFIX + ":")


def parse_spec(model: str) -> dict[str, float]:
    """The parameters of a `synthetic:k=v,...` spec, defaults filled in; ConfigError if bad."""
    params = dict(DEFAULTS)
    _, _, rest = model.partition(":")
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in DEFAULTS:
            raise ConfigError(f"--model {model}: expected key=value with key in {sorted(DEFAULTS)}")
        try:
            params[key] = float(value)
        except ValueError:
            raise ConfigError(f"--model {model}: {key}={value} is not a number") from None
        if params[key] < 0:
            raise ConfigError(f"--model {model}: {key} must be >= 0")
    if params["num_blocks"] < 1 or params["words"] < 1:
        raise ConfigError(f"--model {model}: num_blocks and words must be >= 1")
    return params


def prepare_synthetic_folder(model: str, tokenizer_dir: Path | None = None) -> Path:
    """The folder a `synthetic...` spec serves from, created once beside the default model."""
    params = parse_spec(model)
    source = tokenizer_dir or prepare_default_model()
    changed = [f"{k}-{params[k]:g}" for k in sorted(params) if params[k] != DEFAULTS[k]]
    folder = cache_root() / "models" / "-".join([PREFIX, *changed])
    config = json.loads((source / "config.json").read_text())
    config[MARKER] = {**params, "tokenizer_dir": str(source)}
    if (folder / "config.json").is_file():
        if json.loads((folder / "config.json").read_text()).get(MARKER) == config[MARKER]:
            return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    # built aside and renamed: concurrent starts never see half a folder
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    try:
        for name in _TOKENIZER_FILES:
            if (source / name).is_file():
                os.symlink((source / name).resolve(), tmp / name)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    except OSError:
        if not (folder / "config.json").is_file():  # a concurrent start did not win the race
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def synthetic_params(folder: str | Path) -> dict[str, Any] | None:
    """The parameters if `folder` is a synthetic model's, else None."""
    path = Path(folder) / "config.json"
    if not path.is_file():  # a GGUF file too: never synthetic
        return None
    return json.loads(path.read_text()).get(MARKER)
