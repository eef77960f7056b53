"""gpt-oss's shipped MXFP4 experts as the loader reads them: each expert's blocks and exponents
as stored (views), bad tensors and unserved combinations refused by name."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.layers.linear_methods.weights import MXFP4Weight
from gpu_worker.model_loader.mxfp4 import check_mxfp4, is_mxfp4, split_mxfp4_experts

NAME = "model.layers.0.mlp.experts.gate_up_proj"


def _weights(experts: int = 3, out: int = 8, groups: int = 2) -> dict[str, torch.Tensor]:
    return {
        f"{NAME}_blocks": torch.randint(0, 256, (experts, out, groups, 16), dtype=torch.uint8),
        f"{NAME}_scales": torch.randint(120, 130, (experts, out, groups), dtype=torch.uint8),
    }


def test_split_gives_each_expert_as_stored() -> None:
    weights = _weights()
    blocks, scales = weights[f"{NAME}_blocks"], weights[f"{NAME}_scales"]
    parts = split_mxfp4_experts(weights, NAME)
    assert weights == {}  # popped
    assert len(parts) == 3 and all(isinstance(p, MXFP4Weight) for p in parts)
    assert parts[1].out_features == 8 and parts[1].in_features == 64
    assert torch.equal(parts[2].blocks, blocks[2]) and torch.equal(parts[2].scales, scales[2])
    assert parts[0].blocks.data_ptr() == blocks.data_ptr()  # a view: no copy


def test_bad_tensors_are_refused_by_name() -> None:
    weights = _weights()
    del weights[f"{NAME}_scales"]
    with pytest.raises(KeyError, match=f"{NAME}_scales"):
        split_mxfp4_experts(weights, NAME)
    weights = _weights()
    weights[f"{NAME}_scales"] = weights[f"{NAME}_scales"][:, :, :1]
    with pytest.raises(ValueError, match=f"{NAME}_blocks must be uint8"):
        split_mxfp4_experts(weights, NAME)


def test_mxfp4_configs() -> None:
    cfg = {"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}}
    assert is_mxfp4(cfg) and not is_mxfp4({"model_type": "gpt_oss"})
    check_mxfp4(cfg, "")
    with pytest.raises(ValueError, match="--quantization int8"):
        check_mxfp4(cfg, "int8")
    with pytest.raises(ValueError, match="'mxfp4'.*gpt_oss.*'llama'"):
        check_mxfp4(dict(cfg, model_type="llama"), "")
