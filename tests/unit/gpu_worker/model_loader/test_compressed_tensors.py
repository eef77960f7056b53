"""Reading int8 W8A8 compressed-tensors checkpoints (gpu_worker/model_loader/compressed_tensors.py)
as the server does (the loader's read_checkpoint), written by tools/export_int8.py from tiny
random models."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu_worker.cpu.int8 import quantize_weight
from gpu_worker.distributed.tensor_parallel import TensorParallel
from gpu_worker.layers.linear_methods.weights import concat_rows
from gpu_worker.model_loader import compressed_tensors as ct
from gpu_worker.model_loader.hf_folder import read_hf_config
from gpu_worker.model_loader.loader import read_checkpoint, read_weights
from tests.tiny_models import make_tiny_model
from tools.export_int8 import export_int8


def _read(folder: Path) -> dict[str, Any]:
    """The checkpoint's tensors by HF name, as the server reads them (one rank)."""
    return read_checkpoint(folder, read_hf_config(folder), TensorParallel())


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def exported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """(float source, int8 export) of a tiny model; qwen2 has q/k/v biases. Not smoothed, so
    that every weight compares with the source's (tests/unit/tools/test_smoothquant.py reads
    a smoothed export back)."""
    root = tmp_path_factory.mktemp(f"ct_{request.param}")
    src = make_tiny_model(root / "float", request.param)
    return export_int8(src, root / "int8", smoothquant=0)


def test_round_trip_gives_int8_layers_and_float_rest(exported: Path) -> None:
    source = load_file(str(next((exported.parent / "float").glob("*.safetensors"))))
    weights = _read(exported)
    assert weights.keys() == source.keys()  # the scales are folded into their weights
    for name, original in source.items():
        got = weights[name]
        if any(f".{p}.weight" in name for p in PROJECTIONS):
            assert isinstance(got, ct.Int8Weight)
            q, scale = quantize_weight(original)
            assert torch.equal(got.weight, q) and torch.equal(got.scale, scale)
            assert got.scale.shape == (original.shape[0],) and got.scale.dtype == torch.float32
        else:  # embeddings, norms, biases, LM head: as they were
            assert isinstance(got, torch.Tensor) and torch.equal(got, original), name


def _with_config(exported: Path, dst: Path, edit: Any) -> Path:
    shutil.copytree(exported, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config["quantization_config"])
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _set(path: str, value: Any) -> Any:
    def edit(qc: dict[str, Any]) -> None:
        *keys, last = path.split(".")
        node = qc
        for key in keys:
            node = node[key]
        if isinstance(value, dict):  # several fields of one part at once
            node[last].update(value)
        else:
            node[last] = value

    return edit


REFUSED = [
    ("config_groups.group_0.weights.strategy", "tensor", "weights.strategy"),
    ("config_groups.group_0.weights.symmetric", False, "weights.symmetric"),
    ("config_groups.group_0.weights.num_bits", 4, "weights.num_bits"),
    ("config_groups.group_0.weights.type", "float", "weights.type"),
    # static activation scales (one per tensor, from calibration)
    (
        "config_groups.group_0.input_activations",
        {"dynamic": False, "strategy": "tensor"},
        "input_activations.dynamic",
    ),
    ("config_groups.group_0.input_activations.strategy", "tensor", "input_activations.strategy"),
    ("config_groups.group_0.input_activations", None, "input_activations"),
    ("format", "float-quantized", "format"),
]


@pytest.mark.parametrize(("field", "value", "named"), REFUSED)
def test_schemes_not_served_are_refused_naming_the_field(
    exported: Path, tmp_path: Path, field: str, value: Any, named: str
) -> None:
    folder = _with_config(exported, tmp_path / "edited", _set(field, value))
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        _read(folder)


def test_group_wise_weights_are_refused(exported: Path) -> None:
    qc = json.loads((exported / "config.json").read_text())["quantization_config"]
    grouped = copy.deepcopy(qc)
    grouped["config_groups"]["group_0"]["weights"].update(strategy="group", group_size=128)
    with pytest.raises(ValueError, match=r"weights\.strategy"):
        ct.check_int8_w8a8(grouped)
    assert ct.check_int8_w8a8(qc).format == "int-quantized"


def test_a_folder_without_the_config_or_a_scale_is_refused(exported: Path, tmp_path: Path) -> None:
    plain = exported.parent / "float"
    assert ct.quantization_config(json.loads((plain / "config.json").read_text())) is None
    # without the config the folder is a float checkpoint: nothing is read as int8
    assert not any(isinstance(w, ct.Int8Weight) for w in _read(plain).values())
    folder = tmp_path / "no_scale"
    shutil.copytree(exported, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.0.mlp.up_proj.weight_scale"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"up_proj\.weight_scale is missing"):
        _read(folder)


def test_zero_points_of_zeros_are_dropped_others_refused(exported: Path, tmp_path: Path) -> None:
    folder = tmp_path / "zero_points"
    shutil.copytree(exported, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    name = "model.layers.1.self_attn.o_proj.weight_zero_point"
    tensors[name] = torch.zeros(tensors["model.layers.1.self_attn.o_proj.weight"].shape[0], 1)
    tensors[name] = tensors[name].to(torch.int8)
    save_file(tensors, str(folder / "model.safetensors"))
    weights = _read(folder)
    assert name not in weights
    assert weights.keys() == _read(exported).keys()
    tensors[name][3] = 1
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="weight_zero_point is not zero"):
        _read(folder)


def _packed_copy(exported: Path, folder: Path) -> Path:
    """The same weights packed four to an int32 (compressed-tensors' own packing)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    _with_config(exported, folder, _set("format", "pack-quantized"))
    tensors = load_file(str(folder / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(".weight") and tensors[n].dtype == torch.int8]:
        weight = tensors.pop(name)
        tensors[f"{name}_packed"] = pack_to_int32(weight, 8)
        tensors[f"{name}_shape"] = torch.tensor(weight.shape)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_pack_quantized_reads_as_int_quantized(exported: Path, tmp_path: Path) -> None:
    packed = _read(_packed_copy(exported, tmp_path / "packed"))
    plain = _read(exported)
    assert packed.keys() == plain.keys()
    for name, value in plain.items():
        got = packed[name]
        if isinstance(value, ct.Int8Weight):
            assert isinstance(got, ct.Int8Weight)
            assert torch.equal(got.weight, value.weight) and torch.equal(got.scale, value.scale)


@pytest.mark.parametrize("fmt", ["int-quantized", "pack-quantized"])
def test_tensor_parallel_slices_are_the_whole_cut(exported: Path, tmp_path: Path, fmt: str) -> None:
    """loader.read_weights' slices for 2 ranks (gpu_worker/distributed/sharding.py's splits): a
    column-parallel layer's rows and scales split, a row-parallel one's columns split and
    its scales whole on each rank."""
    folder = exported if fmt == "int-quantized" else _packed_copy(exported, tmp_path / "packed")
    whole = _read(exported)
    shards = [ct.int8_weights(read_weights(folder, TensorParallel(rank=r, size=2))) for r in (0, 1)]
    for layer, dim in [("self_attn.q_proj", 0), ("mlp.up_proj", 0), ("mlp.down_proj", 1)]:
        name = f"model.layers.1.{layer}.weight"
        full, parts = whole[name], [shard[name] for shard in shards]
        assert isinstance(full, ct.Int8Weight)
        assert all(isinstance(part, ct.Int8Weight) for part in parts)
        weights = [part.weight for part in parts if isinstance(part, ct.Int8Weight)]
        scales = [part.scale for part in parts if isinstance(part, ct.Int8Weight)]
        assert torch.equal(torch.cat(weights, dim=dim), full.weight)
        if dim == 0:
            assert torch.equal(torch.cat(scales), full.scale)
        else:
            assert all(torch.equal(scale, full.scale) for scale in scales)


def test_concat_stacks_rows_and_scales() -> None:
    a = ct.Int8Weight(*quantize_weight(torch.randn(3, 8)))
    b = ct.Int8Weight(*quantize_weight(torch.randn(5, 8) * 4))
    fused = concat_rows([a, b])
    assert fused.weight.shape == (8, 8) and fused.scale.shape == (8,)
    assert torch.equal(fused.weight[3:], b.weight) and torch.equal(fused.scale[:3], a.scale)


def test_quantize_at_load_makes_the_projections_int8() -> None:
    gen = torch.Generator().manual_seed(0)
    weights = {
        "model.embed_tokens.weight": torch.randn(10, 8, generator=gen),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=gen),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(8, generator=gen),
        "model.layers.0.mlp.down_proj.weight": torch.randn(8, 16, generator=gen),
        "model.norm.weight": torch.randn(8, generator=gen),
        "lm_head.weight": torch.randn(10, 8, generator=gen),
    }
    out = ct.quantize_linear_weights(weights, torch.bfloat16)
    assert out.keys() == weights.keys()
    for name, t in out.items():
        if name.endswith("proj.weight"):
            assert isinstance(t, ct.Int8Weight)
            assert torch.equal(t.scale, t.scale.bfloat16().float())  # as a bf16 file holds it
            dequant = t.weight.float() * t.scale[:, None]
            assert ((dequant - weights[name]).abs() <= t.scale[:, None] * 0.51).all()
        else:
            assert t is weights[name]
