"""The worker's LoRA settings and the adapters it has loaded, without torch: what both runners
(the model runner's `LoraManager` and the synthetic runner) keep about adapters by name."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from gpu_worker.lora.adapter import AdapterSpec, LoraAdapterError, ModelShape, check_adapter

log = logging.getLogger(__name__)


class LoraModuleFlag(Protocol):
    """One --lora-modules entry (common/lora_config.py's LoraModule)."""

    @property
    def name(self) -> str: ...

    @property
    def path(self) -> str: ...


class LoraFlags(Protocol):
    """The config's LoRA section (common/lora_config.py's LoraConfig), as the worker reads it."""

    @property
    def enable_lora(self) -> bool: ...

    @property
    def max_loras(self) -> int: ...

    @property
    def max_lora_rank(self) -> int: ...

    @property
    def max_cpu_loras(self) -> int: ...

    @property
    def lora_dtype(self) -> str: ...

    @property
    def modules(self) -> Sequence[LoraModuleFlag]: ...


@dataclasses.dataclass(frozen=True)
class LoraOptions:
    """The runner's LoRA settings (vLLM's flags): `max_loras` adapters in one step (the slots
    per model version), ranks up to `max_lora_rank`, `max_cpu_loras` adapters' tensors kept in
    host memory (0: max_loras; evicted ones are read again from their folder), and the
    `modules` ((name, path) pairs of --lora-modules) loaded at start."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 0
    modules: tuple[tuple[str, str], ...] = ()
    dtype: str = "auto"  # the slots' weights: auto (the model's), float32, bfloat16

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"--lora-dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        if self.max_loras < 1:
            raise ValueError(f"--max-loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"--max-lora-rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"--max-cpu-loras ({self.max_cpu_loras}) must be >= --max-loras ({self.max_loras})"
            )
        names = [name for name, _ in self.modules]
        if len(set(names)) != len(names) or not all(names):
            raise ValueError(f"--lora-modules names must be unique and non-empty: {names}")

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras or self.max_loras

    @classmethod
    def from_flags(cls, flags: LoraFlags) -> LoraOptions | None:
        """The runner's options from the config's LoRA section (None without --enable-lora)."""
        if not flags.enable_lora:
            return None
        return cls(
            max_loras=flags.max_loras,
            max_lora_rank=flags.max_lora_rank,
            max_cpu_loras=flags.max_cpu_loras,
            modules=tuple((m.name, m.path) for m in flags.modules),
            dtype=flags.lora_dtype,
        )


def load_start_modules(
    load: Callable[[str, str], AdapterSpec], modules: Sequence[tuple[str, str]]
) -> None:
    """--lora-modules at start: one refused is logged with its error (naming file and field)
    and left out; the model serves on (the scheduler's LoadLora reports it again)."""
    for name, path in modules:
        try:
            load(name, path)
        except LoraAdapterError as e:
            log.error("LoRA adapter %s from --lora-modules refused: %s", name, e)


class LoraRegistry:
    """The adapters loaded now, by name: each one's checked spec (its folder, weights hash
    and rank). Loading a name again replaces it; the order is the order of loading."""

    def __init__(self, options: LoraOptions, shape: ModelShape) -> None:
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
