"""The model versions the real runner holds (hot swap): weights beside weights.

    versions = ModelVersions("v1", first, build)   the first version, built by the runner
    versions.load(path)        read its config, check its KV layout against the pool's, name
                               it, refuse a duplicate, `build` it (backend, weights, graphs)
    versions.set_default(v)    new requests run on v; running ones keep theirs
    versions.unload(v, users)  only a version that is not the default and serves nobody

Every version writes the one KV pool, so all of them have the pool's layout (layers, KV
heads, head size); a model with another layout is refused (`IncompatibleModel`): it swaps in
drain mode, with a new runner. Structured outputs compile per tokenizer: the fingerprint of a
version's tokenizer files is hashed once per folder, and `tokenizer_info` finds the loaded
version with a fingerprint for the grammar compiler (gpu_worker/sample/structured.py).

What `build` does with a folder (backend, weights, graphs) is the runner's: the weights and
backend come from gpu_worker/runner/builder.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import xgrammar

from common.model_facts import tokenizer_fingerprint
from gpu_worker.attention import AttentionBackend
from gpu_worker.model_loader.hf_folder import eos_token_ids, read_hf_config, weights_version
from gpu_worker.models.llama import LlamaForCausalLM
from gpu_worker.models.llama_config import LlamaConfig
from gpu_worker.runner.cuda_graphs import CUDAGraphRunner
from gpu_worker.runner.version_table import VersionTable
from gpu_worker.sample.logits_controls import TokenCounts
from gpu_worker.sample.structured import hf_tokenizer_info

# what a runner builds for a model folder: its attention backend, weights and decode graphs
Built = tuple[AttentionBackend, LlamaForCausalLM, CUDAGraphRunner | None]
# (the model's path, its config.json as read once by `load`)
Build = Callable[[str, dict[str, Any]], Built]


class IncompatibleModel(ValueError):
    """The new model's KV layout differs from the pool's (swap it in drain mode)."""


@dataclasses.dataclass
class ModelVersion:
    """One loaded set of weights; several share the KV pool when their layout matches."""

    backend: AttentionBackend
    model: LlamaForCausalLM
    graphs: CUDAGraphRunner | None
    config: LlamaConfig
    path: str
    eos_token_ids: list[int]
    counts: TokenCounts  # its requests' token counts, for penalties

    @classmethod
    def create(
        cls,
        path: str,
        hf_config: dict[str, Any],
        config: LlamaConfig,
        built: Built,
        device: torch.device,
    ) -> ModelVersion:
        """The version of the folder `path` (config.json read as `hf_config`), once built."""
        backend, model, graphs = built
        counts = TokenCounts(config.vocab_size, device)
        return cls(backend, model, graphs, config, path, eos_token_ids(path, hf_config), counts)


def kv_layout(config: LlamaConfig) -> tuple[int, int, int, tuple[int, ...]]:
    """What must match for two models to share one KV pool: (layers, KV heads, head size,
    the layers' windows: they make the KV layer groups)."""
    return config.num_layers, config.num_kv_heads, config.head_dim, config.sliding_windows


class ModelVersions(VersionTable[ModelVersion]):
    """The real runner's loaded versions: load, default, unload, and tokenizer fingerprints."""

    def __init__(self, label: str, first: ModelVersion, build: Build) -> None:
        super().__init__(label, first)
        self._build = build
        self.kv_layout = kv_layout(first.config)  # the pool's, for every later version
        self._device = first.counts.device
        self._fingerprints: dict[str, str] = {}  # model folder -> its tokenizer's

    def load(self, path: str, version: str = "") -> str:
        """Build the model at `path` beside the loaded ones; returns its version (default: a
        hash of its weight files). Raises IncompatibleModel when its KV layout differs from
        the pool's, ValueError when the version is already loaded."""
        hf_config = read_hf_config(path)
        config = LlamaConfig.from_hf(hf_config)
        if kv_layout(config) != self.kv_layout:
            raise IncompatibleModel(
                f"{path} has KV layout (layers, kv heads, head dim, windows) "
                f"{kv_layout(config)}, "
                f"the pool holds {self.kv_layout}: swap it in drain mode"
            )
        version = version or weights_version(path)
        if version in self:
            raise ValueError(f"model version {version!r} is already loaded")
        built = self._build(path, hf_config)
        self.add(version, ModelVersion.create(path, hf_config, config, built, self._device))
        return version

    def unload(self, version: str, num_users: int) -> None:
        """Free a version's weights once no request uses it (`num_users` do)."""
        if version == self.default_version:
            raise ValueError(f"version {version!r} is the default; switch first")
        if num_users:
            raise ValueError(f"version {version!r} still serves {num_users} requests")
        self.remove(version)

    def fingerprint(self, version: str) -> str:
        """The fingerprint of `version`'s tokenizer files."""
        return self._fingerprint_of(self[version].path)

    def _fingerprint_of(self, path: str) -> str:
        if path not in self._fingerprints:  # (a hash of the tokenizer files: once per folder)
            self._fingerprints[path] = tokenizer_fingerprint(Path(path))
        return self._fingerprints[path]

    def tokenizer_info(self, fingerprint: str) -> xgrammar.TokenizerInfo:
        """xgrammar's view of the tokenizer of a loaded version with that fingerprint (called
        on the grammar compiler's thread: it walks a copy of the table)."""
        for loaded in list(self._versions.values()):
            if self._fingerprint_of(loaded.path) == fingerprint:
                vocab, stops = loaded.config.vocab_size, list(loaded.eos_token_ids)
                return hf_tokenizer_info(loaded.path, vocab, stops)
        raise KeyError(fingerprint)
