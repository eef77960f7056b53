"""gpt-oss checkpoints as shipped: the experts' projections in MXFP4, everything else float.

config.json says `quantization_config: {"quant_method": "mxfp4", "modules_to_not_convert":
[...]}`; each sparse layer stores

    model.layers.{i}.mlp.experts.gate_up_proj_blocks   uint8 [E, 2 * width, hidden / 32, 16]
    model.layers.{i}.mlp.experts.gate_up_proj_scales   uint8 [E, 2 * width, hidden / 32]
    model.layers.{i}.mlp.experts.down_proj_blocks      uint8 [E, hidden, width / 32, 16]
    model.layers.{i}.mlp.experts.down_proj_scales      uint8 [E, hidden, width / 32]

(transformers' integrations/mxfp4.py): rows are the output features (gate and up in alternate
rows), each row's input features in groups of 32, a group 16 bytes of two E2M1 values (the
low nibble first) and an E8M0 exponent (2 ** (scale - 127)). Dequantized, a projection is
[E, out, in], the transpose of the float checkpoints' x @ W layout. The biases stay float.
`split_mxfp4_experts` gives each expert's MXFP4Weight as stored (views, no copy).
"""

from __future__ import annotations

from typing import Any

import torch

from gpu_worker.layers.linear_methods.weights import MXFP4Weight

QUANT_METHOD = "mxfp4"


def is_mxfp4(hf_config: dict[str, Any]) -> bool:
    """Whether config.json says MXFP4 (gpt-oss's shipped experts)."""
    qc = hf_config.get("quantization_config")
    return isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD


def check_mxfp4(hf_config: dict[str, Any], quantization: str) -> None:
    """Refuse by name what an MXFP4 folder is not served with."""
    model_type = hf_config.get("model_type")
    if model_type != "gpt_oss":
        raise ValueError(
            f"quantization_config.quant_method 'mxfp4' is served for gpt_oss experts, "
            f"not for model_type {model_type!r}"
        )
    if quantization:
        raise ValueError(
            f"--quantization {quantization}: the checkpoint is MXFP4 already "
            "(quantization_config.quant_method 'mxfp4')"
        )


def split_mxfp4_experts(weights: dict[str, Any], name: str) -> list[MXFP4Weight]:
    """The experts of projection `name` (`{name}_blocks` / `{name}_scales`, popped from
    `weights`), one MXFP4Weight each. Raises KeyError or ValueError naming a bad tensor."""
    for suffix in ("_blocks", "_scales"):
        if f"{name}{suffix}" not in weights:
            raise KeyError(f"checkpoint has no {name}{suffix}")
    blocks, scales = weights.pop(f"{name}_blocks"), weights.pop(f"{name}_scales")
    if (
        blocks.dtype != torch.uint8
        or scales.dtype != torch.uint8
        or blocks.dim() != 4
        or blocks.shape[-1] != 16
        or tuple(scales.shape) != tuple(blocks.shape[:-1])
    ):
        raise ValueError(
            f"{name}_blocks must be uint8 [experts, out, in / 32, 16] and {name}_scales uint8 "
            f"[experts, out, in / 32]; got {blocks.dtype} {list(blocks.shape)} and "
            f"{scales.dtype} {list(scales.shape)}"
        )
    return [MXFP4Weight(b, s) for b, s in zip(blocks, scales, strict=True)]
