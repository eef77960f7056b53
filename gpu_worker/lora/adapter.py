"""PEFT LoRA adapter folders, read and checked against the served model.

A folder holds `adapter_config.json` and `adapter_model.safetensors` (a pickled
`adapter_model.bin` is refused by name). Tensors are named as PEFT saves them:

    base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.{i}.mlp.{gate,up,down}_proj.lora_B.weight     [out, r]

Each module's delta is `scaling * B @ A`, scaling = lora_alpha / r (rsLoRA: / sqrt(r)), with
r and alpha of the module from `rank_pattern` / `alpha_pattern` when they name it (PEFT's
`get_pattern_key` rule). Variants that change the forward pass (DoRA, biases, saved
modules, embedding targets...) are refused by the field that asks for them. Every error is a
`LoraAdapterError` naming the file and the field or tensor.

`check_adapter` is pure (json and the safetensors header: the synthetic runner uses it
without torch); `load_adapter` also reads the tensors, with the scaling folded into B;
`shard_module` cuts a module's A/B for one tensor-parallel rank like the layer it modifies.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpu_worker.distributed.sharding import Split, even_range, split_of

if TYPE_CHECKING:
    import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"
# the PEFT module names we serve (gpu_worker/lora/layer.py's TARGET_SLICES, without torch)
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PARENT = {m: "self_attn" if m[0] in "qkvo" else "mlp" for m in TARGET_MODULES}
_TENSOR = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(\w+)\.(\w+)\.lora_(A|B)\.weight$")
_DTYPES = ("F32", "F16", "BF16")
# config fields of LoRA variants whose forward pass differs from B @ A: must be unset
_REFUSED = {
    "use_dora": "DoRA adapters",
    "lora_bias": "LoRA biases",
    "modules_to_save": "fully trained modules (modules_to_save)",
    "target_parameters": "parameter targets",
    "trainable_token_indices": "trained embedding tokens",
    "layer_replication": "layer replication",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
    "arrow_config": "Arrow routing",
    "use_bdlora": "block-diagonal LoRA",
    "kasa_config": "KaSA adapters",
    "monteclora_config": "MonteCLoRA adapters",
    "velora_config": "VeLoRA adapters",
    "use_qalora": "QALoRA adapters",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D) weights",
}
ModuleKey = tuple[int, str]  # (decoder layer, PEFT module name)


class LoraAdapterError(ValueError):
    """An adapter folder that cannot be served; the message names the file and the field or
    tensor at fault (serving goes on without the adapter)."""


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The base model's sizes an adapter's tensors must match (the whole model, not a
    tensor-parallel shard)."""

    num_layers: int
    hidden_size: int
    q_size: int  # num_heads * head_dim
    kv_size: int  # num_kv_heads * head_dim
    intermediate_size: int

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelShape:
        """From a Hugging Face config.json's fields."""
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        return cls(
            num_layers=cfg["num_hidden_layers"],
            hidden_size=cfg["hidden_size"],
            q_size=heads * head_dim,
            kv_size=(cfg.get("num_key_value_heads") or heads) * head_dim,
            intermediate_size=cfg["intermediate_size"],
        )

    def in_out(self, module: str) -> tuple[int, int]:
        """(in features, out features) of a target module."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (h, self.q_size),
            "k_proj": (h, self.kv_size),
            "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }[module]


@dataclasses.dataclass(frozen=True)
class ModuleSpec:
    rank: int
    scaling: float  # folded into B at load


@dataclasses.dataclass(frozen=True)
class AdapterSpec:
    """A checked adapter folder: its identity and, per targeted module, rank and scaling."""

    name: str
    path: str
    rank: int  # the largest rank of its modules
    weights_hash: str  # sha256 of adapter_config.json + the safetensors bytes, short hex
    base_model_name: str  # base_model_name_or_path, as PEFT recorded it ("" if absent)
    modules: dict[ModuleKey, ModuleSpec]


@dataclasses.dataclass(frozen=True)
class LoraAdapter:
    """An adapter in memory: per module, A [r, in] and B [out, r] (scaling folded into B),
    float32, on the CPU."""

    spec: AdapterSpec
    weights: dict[ModuleKey, tuple[torch.Tensor, torch.Tensor]]

    @property
    def name(self) -> str:
        return self.spec.name


def check_adapter(name: str, path: str, shape: ModelShape, max_rank: int) -> AdapterSpec:
    """Read and check the folder at `path` without loading a tensor (LoraAdapterError)."""
    folder = Path(path).expanduser()
    config = read_config(folder)
    weights = folder / WEIGHTS_FILE
    header = _read_header(folder, weights)
    modules = _check_tensors(weights, header, config, shape, max_rank)
    return AdapterSpec(
        name=name,
        path=str(folder),
        rank=max(m.rank for m in modules.values()),
        weights_hash=weights_hash(folder),
        base_model_name=str(config.get("base_model_name_or_path") or ""),
        modules=modules,
    )


def load_adapter(name: str, path: str, shape: ModelShape, max_rank: int) -> LoraAdapter:
    """`check_adapter`, then the tensors: float32, scaling folded into B."""
    return read_weights(check_adapter(name, path, shape, max_rank))


def read_weights(spec: AdapterSpec) -> LoraAdapter:
    """The tensors of a checked adapter: float32, scaling folded into B."""
    from safetensors.torch import load_file

    weights_file = Path(spec.path) / WEIGHTS_FILE
    try:
        tensors = load_file(weights_file)
    except Exception as e:  # safetensors raises its own error types for a damaged file
        raise LoraAdapterError(f"{weights_file}: cannot be read ({e})") from e
    weights = {}
    for (layer, module), m in spec.modules.items():
        prefix = f"base_model.model.model.layers.{layer}.{_PARENT[module]}.{module}"
        a = tensors[f"{prefix}.lora_A.weight"].float()
        b = tensors[f"{prefix}.lora_B.weight"].float() * m.scaling
        weights[(layer, module)] = (a.contiguous(), b.contiguous())
    return LoraAdapter(spec, weights)


def shard_module(
    module: str, a: torch.Tensor, b: torch.Tensor, rank: int, world: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One tensor-parallel rank's A and B of a module, cut like the layer it modifies
    (gpu_worker/distributed/sharding.py): a column-parallel layer (q/k/v, gate/up) keeps its output
    rows, so B's rows split and A is whole; a row-parallel one (o, down) keeps its input columns,
    so A's columns split and B is whole, and the delta is a partial sum the layer's
    all-reduce completes."""
    if world == 1:
        return a, b
    if split_of(f"{module}.weight") is Split.COLUMN:
        lo, hi = even_range(b.shape[0], rank, world)
        return a, b[lo:hi]
    lo, hi = even_range(a.shape[1], rank, world)
    return a[:, lo:hi], b


def weights_hash(folder: Path) -> str:
    """sha256 over adapter_config.json and the safetensors file, 16 hex digits."""
    digest = hashlib.sha256()
    for file in (folder / CONFIG_FILE, folder / WEIGHTS_FILE):
        with file.open("rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


# adapter_config.json -----------------------------------------------------------------------
def read_config(folder: Path) -> dict[str, Any]:
    """adapter_config.json, checked field by field."""
    file = folder / CONFIG_FILE
    if not folder.is_dir():
        raise LoraAdapterError(f"{folder}: not a folder (a PEFT adapter is a folder)")
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError:
        raise LoraAdapterError(f"{file}: missing (not a PEFT adapter folder)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoraAdapterError(f"{file}: not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise LoraAdapterError(f"{file}: not a JSON object")
    _check_config(file, config)
    return config


def _check_config(file: Path, config: dict[str, Any]) -> None:
    def bad(field: str, why: str) -> LoraAdapterError:
        return LoraAdapterError(f"{file}: field {field!r} {why}")

    if config.get("peft_type", "LORA") != "LORA":
        raise bad("peft_type", f"is {config['peft_type']!r}; only LORA adapters are served")
    r = config.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise bad("r", f"must be a positive integer, got {r!r}")
    alpha = config.get("lora_alpha", r)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise bad("lora_alpha", f"must be a number, got {alpha!r}")
    if config.get("bias", "none") != "none":
        raise bad("bias", f"is {config['bias']!r}; only 'none' is served")
    for field, what in _REFUSED.items():
        if config.get(field):
            raise bad(field, f"is set: {what} are not served")
    for field in ("rank_pattern", "alpha_pattern"):
        pattern = config.get(field) or {}
        if not isinstance(pattern, dict) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in pattern.values()
        ):
            raise bad(field, f"must map module patterns to numbers, got {pattern!r}")
    _check_targets(file, config.get("target_modules"))


def _check_targets(file: Path, targets: Any) -> None:
    """A list of module names (or "all-linear"), each among TARGET_MODULES; a regex string
    is checked by the tensors it produced."""
    if isinstance(targets, str):
        try:
            re.compile(targets)
        except re.error as e:
            raise LoraAdapterError(f"{file}: field 'target_modules' is a bad regex ({e})") from e
        return
    if not isinstance(targets, list) or not targets:
        raise LoraAdapterError(
            f"{file}: field 'target_modules' must be a list of module names or a regex, "
            f"got {targets!r}"
        )
    for target in targets:
        last = str(target).rsplit(".", 1)[-1]
        if target != "all-linear" and last not in TARGET_MODULES:
            raise LoraAdapterError(
                f"{file}: field 'target_modules' names {target!r}; the targets served are "
                f"{', '.join(TARGET_MODULES)}"
            )


def _module_value(pattern: dict[str, Any], key: str, default: float) -> float:
    """PEFT's get_pattern_key: the first pattern that matches the end of the module name."""
    for p in pattern:
        if re.match(rf"(.*\.)?({p})$", key):
            return float(pattern[p])
    return default


def _scaling(config: dict[str, Any], key: str) -> tuple[int, float]:
    """(rank, scaling) of the module named `key` (model.layers.0.self_attn.q_proj)."""
    r = int(_module_value(config.get("rank_pattern") or {}, key, config["r"]))
    alpha = _module_value(config.get("alpha_pattern") or {}, key, config.get("lora_alpha", r))
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    return r, scale


# adapter_model.safetensors -----------------------------------------------------------------
def _read_header(folder: Path, file: Path) -> dict[str, Any]:
    """The safetensors header: {tensor name: {dtype, shape, data_offsets}}."""
    if not file.is_file():
        if (folder / PICKLE_FILE).is_file():
            raise LoraAdapterError(
                f"{folder / PICKLE_FILE}: pickled weights are not read; save the adapter "
                f"with safe_serialization=True ({WEIGHTS_FILE})"
            )
        raise LoraAdapterError(f"{file}: missing")
    try:
        with file.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > file.stat().st_size:
                raise ValueError(f"header of {size} bytes is longer than the file")
            header = json.loads(f.read(size))
    except (OSError, struct.error, ValueError, UnicodeDecodeError) as e:
        raise LoraAdapterError(f"{file}: not a safetensors file ({e})") from e
    if not isinstance(header, dict):
        raise LoraAdapterError(f"{file}: not a safetensors file (bad header)")
    header.pop("__metadata__", None)
    return header


def _check_tensors(
    file: Path,
    header: dict[str, Any],
    config: dict[str, Any],
    shape: ModelShape,
    max_rank: int,
) -> dict[ModuleKey, ModuleSpec]:
    """Every tensor's name, dtype and shape; each module's A and B present together."""
    found: dict[ModuleKey, dict[str, list[int]]] = {}
    for tensor, info in header.items():
        match = _TENSOR.match(tensor)
        module = match.group(3) if match else ""
        if match is None or _PARENT.get(module) != match.group(2):
            raise LoraAdapterError(
                f"{file}: tensor {tensor!r} is not a LoRA weight of a served target "
                f"({', '.join(TARGET_MODULES)})"
            )
        layer = int(match.group(1))
        if layer >= shape.num_layers:
            raise LoraAdapterError(
                f"{file}: tensor {tensor!r}: layer {layer}, the model has {shape.num_layers}"
            )
        if info.get("dtype") not in _DTYPES:
            raise LoraAdapterError(f"{file}: tensor {tensor!r} has dtype {info.get('dtype')}")
        found.setdefault((layer, module), {})[match.group(4)] = list(info.get("shape", []))
    if not found:
        raise LoraAdapterError(f"{file}: holds no LoRA tensor")
    return {
        key: _check_module(file, key, found[key], config, shape, max_rank) for key in sorted(found)
    }


def _check_module(
    file: Path,
    key: ModuleKey,
    shapes: dict[str, list[int]],
    config: dict[str, Any],
    shape: ModelShape,
    max_rank: int,
) -> ModuleSpec:
    layer, module = key
    name = f"model.layers.{layer}.{_PARENT[module]}.{module}"
    for side in ("A", "B"):
        if side not in shapes:
            raise LoraAdapterError(f"{file}: tensor 'base_model.model.{name}.lora_{side}' missing")
    rank, scaling = _scaling(config, name)
    if rank > max_rank:
        raise LoraAdapterError(
            f"{file.parent / CONFIG_FILE}: field 'r' (or 'rank_pattern'): rank {rank} of "
            f"{name} is above the limit of {max_rank} (--max-lora-rank)"
        )
    n_in, n_out = shape.in_out(module)
    for side, want in (("A", [rank, n_in]), ("B", [n_out, rank])):
        if shapes[side] != want:
            raise LoraAdapterError(
                f"{file}: tensor 'base_model.model.{name}.lora_{side}.weight' has shape "
                f"{shapes[side]}, the model and rank {rank} need {want}"
            )
    return ModuleSpec(rank=rank, scaling=scaling)
