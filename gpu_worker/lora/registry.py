"""The adapters a worker has loaded, without torch: what both runners (the model runner's
`LoraManager` and the synthetic runner) keep about adapters by name. Their settings are the
config's LoRA section (common/lora_config.py's LoraConfig), read as it is."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from common.lora_config import LoraConfig, LoraModule
from gpu_worker.lora.adapter import AdapterSpec, LoraAdapterError, ModelShape, check_adapter

log = logging.getLogger(__name__)


def load_start_modules(
    load: Callable[[str, str], AdapterSpec], modules: Sequence[LoraModule]
) -> None:
    """--lora-modules at start: one refused is logged with its error (naming file and field)
    and left out; the model serves on (the scheduler's LoadLora reports it again)."""
    for module in modules:
        try:
            load(module.name, module.path)
        except LoraAdapterError as e:
            log.error("LoRA adapter %s from --lora-modules refused: %s", module.name, e)


class LoadedAdapterSpecs:
    """The adapters loaded now, by name: each one's checked spec (its folder, weights hash
    and rank). Loading a name again replaces it; the order is the order of loading."""

    def __init__(self, options: LoraConfig, shape: ModelShape) -> None:
        self.options = options
        self.shape = shape
        self.specs: dict[str, AdapterSpec] = {}

    def __contains__(self, name: object) -> bool:
        return name in self.specs

    def check(self, name: str, path: str) -> AdapterSpec:
        """The folder's spec, checked against the model and the rank limit (nothing kept)."""
        if not name:
            raise LoraAdapterError(f"{path}: an adapter needs a name")
        return check_adapter(name, path, self.shape, self.options.max_lora_rank)

    def add(self, spec: AdapterSpec) -> None:
        self.specs.pop(spec.name, None)
        self.specs[spec.name] = spec

    def remove(self, name: str) -> AdapterSpec:
        """Forget `name` (a KeyError naming it when it is not loaded)."""
        if name not in self.specs:
            raise KeyError(f"LoRA adapter {name!r} is not loaded")
        return self.specs.pop(name)

    def spec(self, name: str) -> AdapterSpec:
        if name not in self.specs:
            raise LoraAdapterError(f"LoRA adapter {name!r} is not loaded")
        return self.specs[name]

    def model_info_fields(self) -> dict[str, Any]:
        """ModelInfo's LoRA fields (common/messages/types.py)."""
        specs = list(self.specs.values())
        return {
            "max_loras": self.options.max_loras,
            "max_lora_rank": self.options.max_lora_rank,
            "lora_names": [s.name for s in specs],
            "lora_paths": [s.path for s in specs],
            "lora_weights_hashes": [s.weights_hash for s in specs],
            "lora_ranks": [s.rank for s in specs],
        }
