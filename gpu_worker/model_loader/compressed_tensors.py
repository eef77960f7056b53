"""Read int8 W8A8 checkpoints in the compressed-tensors format (what LLM Compressor writes and
vLLM serves): int8 weights with one scale per output row, activations quantized dynamically
per token, both symmetric.

A folder is such a checkpoint when its config.json has a `quantization_config` whose
`quant_method` is "compressed-tensors". The config is parsed by compressed-tensors' own
`QuantizationConfig` and checked against the one scheme we serve (SERVED below); anything
else (group-wise or block weights, asymmetric, static activation scales, 4-bit, float8, a KV
cache scheme...) is refused with a ValueError naming the field. In the safetensors files a
quantized layer `X` has `X.weight` (int8 [out, in]; "pack-quantized": `X.weight_packed` int32
and `X.weight_shape`) and `X.weight_scale` ([out, 1], float);
layers in `ignore` (the LM head, usually) and everything else stay float.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from gpu_worker.layers.linear_methods.weights import Int8Weight

QUANT_METHOD = "compressed-tensors"
# the linear layers made int8 from a float checkpoint, by Hugging Face weight name (Llama,
# Qwen2/3, Mistral): attention and MLP projections, and a mixture of experts' expert
# projections (Mixtral's w1/w2/w3); embeddings, routers and the LM head stay float
QUANTIZED_LINEARS = re.compile(
    r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$"
)
# storage formats: the int8 [out, in] weight as it is ("naive" is the older name), or packed
# four to an int32 (`X.weight_packed` + `X.weight_shape`, unpacked by compressed-tensors)
SERVED_FORMATS = ("int-quantized", "naive-quantized", "pack-quantized")
# the scheme served: field -> value, for weights and input activations
SERVED = {
    "weights": {
        "num_bits": 8,
        "type": "int",
        "symmetric": True,
        "strategy": "channel",
        "group_size": None,
        "block_structure": None,
        "dynamic": False,
    },
    "input_activations": {
        "num_bits": 8,
        "type": "int",
        "symmetric": True,
        "dynamic": True,
        "strategy": "token",
        "group_size": None,
    },
}


def quantization_config(hf_config: dict[str, Any]) -> dict[str, Any] | None:
    """config.json's compressed-tensors `quantization_config`, or None when the folder is
    not a compressed-tensors checkpoint (no quantization, or another method)."""
    qc = hf_config.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != QUANT_METHOD:
        return None
    return qc


def _value(v: Any) -> Any:
    return v.value if hasattr(v, "value") else v


def _check_args(where: str, args: Any, served: dict[str, Any]) -> None:
    if args is None:
        raise ValueError(f"{where}: missing; int8 W8A8 serving needs {served}")
    for field, want in served.items():
        got = _value(getattr(args, field))
        if got != want:
            raise ValueError(f"{where}.{field} is {got!r}; only {want!r} is served (int8 W8A8)")


def check_int8_w8a8(qc: dict[str, Any]) -> Any:
    """Parse `quantization_config` with compressed-tensors' QuantizationConfig and check that
    every config group is the int8 W8A8 scheme we serve; returns the parsed config. Raises
    ValueError naming the first field that is not served."""
    from compressed_tensors.quantization import QuantizationConfig
    from pydantic import ValidationError

    try:
        config = QuantizationConfig.model_validate(qc)
    except ValidationError as e:
        raise ValueError(f"quantization_config is not a compressed-tensors config: {e}") from e
    if config.format not in SERVED_FORMATS:
        raise ValueError(
            f"quantization_config.format is {config.format!r}; served: {SERVED_FORMATS}"
        )
    if config.kv_cache_scheme is not None:
        raise ValueError("quantization_config.kv_cache_scheme is set; a float KV cache is served")
    if not config.config_groups:
        raise ValueError("quantization_config.config_groups is empty")
    for name, scheme in config.config_groups.items():
        where = f"quantization_config.config_groups.{name}"
        for part, served in SERVED.items():
            _check_args(f"{where}.{part}", getattr(scheme, part), served)
        if scheme.output_activations is not None:
            raise ValueError(f"{where}.output_activations is set; not served (int8 W8A8)")
    return config


def _scale(name: str, scale: torch.Tensor, out_features: int) -> torch.Tensor:
    if scale.numel() != out_features:
        raise ValueError(
            f"{name}_scale has shape {tuple(scale.shape)}; per-channel needs [{out_features}, 1]"
        )
    return scale.reshape(out_features).to(torch.float32).contiguous()


def _unpack(tensors: dict[str, torch.Tensor]) -> None:
    """ "pack-quantized" layers in place: `X.weight_packed` + `X.weight_shape` -> `X.weight`
    int8 (a no-op for the other formats). A tensor-parallel slice unpacks to its own rows and
    columns (a row-parallel slice must start on a multiple of 4 columns)."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    for name in [n for n in tensors if n.endswith(".weight_packed")]:
        base = name[: -len("_packed")]
        shape = tensors.pop(f"{base}_shape", None)
        if shape is None:
            raise ValueError(f"{name} has no {base}_shape beside it")
        packed = tensors.pop(name)
        columns = min(int(shape[1]), packed.shape[1] * 4)
        local = torch.Size((packed.shape[0], columns))
        tensors[base] = unpack_from_int32(packed, 8, local).contiguous()


def int8_weights(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | Int8Weight]:
    """A checkpoint's raw tensors (all of them, or one rank's slices as loader.read_weights
    gives them) by Hugging Face name -> an Int8Weight under `X.weight` for each int8 layer
    (its `X.weight_scale` consumed, an all-zero `X.weight_zero_point` dropped, pack-quantized
    layers unpacked), the float tensors as they are. `tensors` is consumed. Raises ValueError
    for an int8 weight without its scale."""
    _unpack(tensors)
    out: dict[str, torch.Tensor | Int8Weight] = {}
    for name, t in tensors.items():
        if name.endswith(".weight_scale"):
            if name[: -len("_scale")] not in tensors:
                raise ValueError(f"{name} has no weight beside it")
        elif name.endswith(".weight_zero_point"):
            # older compressed-tensors wrote zeros for symmetric schemes too; anything else
            # would be an asymmetric weight, which the config check has already refused
            if bool(t.any()):
                raise ValueError(f"{name} is not zero; only symmetric weights are served")
        elif t.dtype == torch.int8 and name.endswith(".weight"):
            if f"{name}_scale" not in tensors:
                raise ValueError(f"{name} is int8 but {name}_scale is missing")
            out[name] = Int8Weight(t.contiguous(), _scale(name, tensors[f"{name}_scale"], len(t)))
        else:
            out[name] = t
    return out


def quantize_linear_weights(
    weights: dict[str, torch.Tensor], scale_dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor | Int8Weight]:
    """A float checkpoint's tensors with every QUANTIZED_LINEARS weight made an Int8Weight
    (symmetric per output row, gpu_worker/cpu/int8.py's quantize_weight; scales rounded to
    `scale_dtype`), the rest as they are: quantization at load, and what tools/export_int8.py
    writes."""
    from gpu_worker.cpu.int8 import quantize_weight

    out: dict[str, torch.Tensor | Int8Weight] = {}
    for name, t in weights.items():
        if QUANTIZED_LINEARS.search(name) and t.dim() == 2 and t.is_floating_point():
            out[name] = Int8Weight(*quantize_weight(t, scale_dtype))
        else:
            out[name] = t
    return out
