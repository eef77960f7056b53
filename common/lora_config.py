"""LoRA's config section (vLLM's flags) and `--lora-modules` parsing.

    --enable-lora --lora-modules sql=/adapters/sql '{"name": "chat", "path": "/a/chat",
        "base_model_name": "SmolLM2-135M-Instruct"}' --max-loras 4 --max-lora-rank 16

`--lora-modules` takes vLLM's two forms: `name=path`, and a JSON object with `name`, `path`
and optionally `base_model_name` (the adapter is refused, and dropped at a hot swap, when
the served model's name differs). In the config (and SHUTTLE_LORA_MODULES) the entries are
one string, separated by newlines; a `name=path` entry may also be separated by spaces.
"""

from __future__ import annotations

import dataclasses
import json

from common.config_base import ConfigError, config_field

# vLLM's MaxLoRARanks: the ranks --max-lora-rank may take
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# --lora-dtype: the adapters' weights in the slots (auto: the model's dtype)
LORA_DTYPES = ("auto", "float32", "bfloat16")
# names a request's `model` may carry: what a file name, a URL segment and a label allow
MAX_LORA_NAME_CHARS = 128


@dataclasses.dataclass(frozen=True)
class LoraModule:
    """One adapter served from start-up (or loaded at run time): its name and folder."""

    name: str
    path: str
    base_model_name: str = ""  # "": whatever model is served


def check_lora_name(name: str, field: str = "lora_name") -> None:
    """A usable adapter name: 1..128 printable characters without spaces or '='."""
    ok = 0 < len(name) <= MAX_LORA_NAME_CHARS and name.isprintable()
    if not ok or any(c.isspace() or c == "=" for c in name):
        raise ConfigError(
            f"{field}: an adapter name must be 1..{MAX_LORA_NAME_CHARS} printable characters "
            f"without spaces or '=', got {name!r}"
        )


def parse_lora_modules(text: str) -> list[LoraModule]:
    """The entries of `--lora-modules` (one string, entries separated by newlines or, for
    `name=path`, spaces); raises ConfigError naming the entry that is malformed."""
    modules: list[LoraModule] = []
    decoder = json.JSONDecoder()
    i = 0
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        if text[i] == "{":
            try:
                obj, i = decoder.raw_decode(text, i)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--lora-modules: an entry is not valid JSON ({e})") from None
            modules.append(_module_from_json(obj))
            continue
        end = i
        while end < len(text) and not text[end].isspace():
            end += 1
        modules.append(_module_from_pair(text[i:end]))
        i = end
    names = [m.name for m in modules]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ConfigError(f"--lora-modules: the adapter name {dup!r} is given twice")
    return modules


def _module_from_pair(entry: str) -> LoraModule:
    name, eq, path = entry.partition("=")
    if not eq or not name or not path:
        raise ConfigError(
            f"--lora-modules: {entry!r} is neither name=path nor a JSON object "
            '{"name": ..., "path": ..., "base_model_name": ...}'
        )
    check_lora_name(name, "--lora-modules")
    return LoraModule(name, path)


def _module_from_json(obj: object) -> LoraModule:
    if not isinstance(obj, dict):
        raise ConfigError("--lora-modules: a JSON entry must be an object")
    unknown = sorted(set(obj) - {"name", "path", "base_model_name"})
    if unknown:
        raise ConfigError(f"--lora-modules: unknown field {unknown[0]!r} in {obj}")
    for key in ("name", "path"):
        if not isinstance(obj.get(key), str) or not obj[key]:
            raise ConfigError(f"--lora-modules: {key!r} is required (a string) in {obj}")
    base = obj.get("base_model_name", "")
    if not isinstance(base, str):
        raise ConfigError(f"--lora-modules: 'base_model_name' must be a string in {obj}")
    check_lora_name(obj["name"], "--lora-modules")
    return LoraModule(obj["name"], obj["path"], base)


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Multi-LoRA serving: adapters beside the base model, selected by a request's `model`."""

    enable_lora: bool = config_field(False, "serve LoRA adapters (PEFT folders) beside the model")
    lora_modules: str = dataclasses.field(
        default="",
        metadata={
            "help": "adapters served from start-up: name=path, or JSON "
            '{"name": ..., "path": ..., "base_model_name": ...}; several entries in one flag',
            "nargs": "+",
            "sep": "\n",
        },
    )
    max_loras: int = config_field(1, "most distinct adapters in one step (adapter slots)")
    max_lora_rank: int = config_field(16, f"largest adapter rank: one of {MAX_LORA_RANKS}")
    max_cpu_loras: int = config_field(
        0, "adapters kept in the worker's CPU-side cache (0: --max-loras); >= --max-loras"
    )

    lora_dtype: str = config_field(
        "auto",
        "the adapters' weights in memory: auto (the model's dtype), float32 or bfloat16 "
        "(half the bytes a step reads; the deltas are summed in float32 either way)",
    )

    def __post_init__(self) -> None:
        if self.lora_dtype not in LORA_DTYPES:
            raise ConfigError(f"--lora-dtype must be one of {LORA_DTYPES}, got {self.lora_dtype!r}")
        if self.lora_modules.strip() and not self.enable_lora:
            raise ConfigError("--lora-modules needs --enable-lora")
        if self.max_loras < 1:
            raise ConfigError("--max-loras must be >= 1")
        if self.max_lora_rank not in MAX_LORA_RANKS:
            raise ConfigError(f"--max-lora-rank must be one of {MAX_LORA_RANKS}")
        if self.max_cpu_loras and self.max_cpu_loras < self.max_loras:
            raise ConfigError(
                f"--max-cpu-loras must be >= --max-loras ({self.max_loras}), or 0 for it"
            )
        parse_lora_modules(self.lora_modules)  # a malformed entry fails at start-up

    @property
    def modules(self) -> list[LoraModule]:
        """--lora-modules, parsed."""
        return parse_lora_modules(self.lora_modules)

    @property
    def cpu_loras(self) -> int:
        """The CPU-side cache's size: --max-cpu-loras, or --max-loras when 0."""
        return self.max_cpu_loras or self.max_loras
