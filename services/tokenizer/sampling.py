"""How the tokenizer completes a request's sampling parameters (pure logic: no zmq, no torch):
the model's defaults for the fields the client left unset, and bad words as token ids.

Defaults, as vLLM's `--generation-config auto`: a field the client did not set takes the model's
value from generation_config.json when the file has one; `--generation-config vllm` ignores
the file (every unset field keeps vLLM's neutral default: temperature 1, top_p 1, top_k
off, min_p 0, repetition_penalty 1). vLLM reads the file's non-default values
(GenerationConfig.to_diff_dict), so a `top_k` of 50, transformers' own default, is not a
model default; here likewise.

Bad words, as vLLM tokenises them: each word without its leading spaces, and again after
one space (the form it takes inside a text) when that gives another first token in as many
tokens.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.limits import GENERATION_CONFIG_RANGES
from common.messages import SamplingParams
from common.messages.types import MODEL_DEFAULT_FIELDS
from common.model_paths import tokenizer_dir

log = logging.getLogger(__name__)

GENERATION_CONFIG_MODES = ("auto", "vllm")
_TRANSFORMERS_DEFAULTS: dict[str, float] = {"top_k": 50}  # not a model's choice (see above)


def read_sampling_defaults(model_dir: Path, mode: str = "auto") -> dict[str, float]:
    """The model's defaults for MODEL_DEFAULT_FIELDS fields: {} with mode "vllm", without a
    generation_config.json, or for values outside their range (logged, then ignored)."""
    if mode not in GENERATION_CONFIG_MODES:
        raise ValueError(f"generation_config must be one of {GENERATION_CONFIG_MODES}")
    path = tokenizer_dir(model_dir) / "generation_config.json"  # a GGUF file's: its folder's
    if mode == "vllm" or not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        log.warning("ignoring %s: %s", path, e)
        return {}
    defaults: dict[str, float] = {}
    for name in MODEL_DEFAULT_FIELDS:
        value = config.get(name) if isinstance(config, dict) else None
        if value is None or value == _TRANSFORMERS_DEFAULTS.get(name):
            continue
        if _valid(name, value):
            defaults[name] = value
        else:
            log.warning("ignoring %s=%r in %s: out of range", name, value, path)
    return defaults


def _valid(name: str, value: Any) -> bool:
    """In the range a request may ask for (common/limits.py); top_k an integer."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    if name == "top_k" and not isinstance(value, int):
        return False
    return value in GENERATION_CONFIG_RANGES[name]


def fill_defaults(
    sampling: SamplingParams, unset: list[str], defaults: dict[str, float]
) -> SamplingParams:
    """`sampling` with each field the client left unset taken from the model's defaults."""
    changes: dict[str, Any] = {
        name: defaults[name] for name in unset if name in defaults and name in MODEL_DEFAULT_FIELDS
    }
    if "top_k" in changes:
        changes["top_k"] = max(int(changes["top_k"]), 0)  # -1 = off = our 0
    return dataclasses.replace(sampling, **changes) if changes else sampling


def bad_words_token_ids(words: list[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """The token-id sequences the worker bans for these words (`encode`: text -> ids,
    without special tokens)."""
    sequences: list[list[int]] = []
    for word in words:
        plain = encode(word.lstrip())
        if not plain:
            continue
        sequences.append(plain)
        spaced = encode(" " + word.lstrip())
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return sequences
