"""PEFT adapter folders (gpu_worker/lora/adapter.py): read as peft saved them, checked against
the model, and refused with an error naming the file and the field or tensor."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu_worker.lora.adapter import (
    CONFIG_FILE,
    TARGET_MODULES,
    WEIGHTS_FILE,
    LoraAdapterError,
    ModelShape,
    check_adapter,
    load_adapter,
    shard_module,
)
from gpu_worker.lora.layer import TARGET_SLICES
from tests.lora_adapters import peft_model

PREFIX = "base_model.model.model.layers"


def _shape(tiny_dir: Path) -> ModelShape:
    return ModelShape.from_hf(json.loads((tiny_dir / "config.json").read_text()))


def test_the_targets_are_the_layer_contracts() -> None:
    assert set(TARGET_MODULES) == set(TARGET_SLICES)


def test_a_peft_adapter_reads_with_its_ranks_and_scalings(
    tiny_dir: Path, adapter_dir: Path, rslora_dir: Path
) -> None:
    shape = _shape(tiny_dir)
    spec = check_adapter("a", str(adapter_dir), shape, max_rank=8)
    assert spec.rank == 4 and spec.name == "a" and spec.base_model_name == str(tiny_dir)
    assert len(spec.modules) == 2 * 7  # every target of both layers
    assert spec.modules[(1, "q_proj")].rank == 4
    assert spec.modules[(1, "q_proj")].scaling == 8 / 4
    assert spec.modules[(0, "v_proj")].rank == 2  # rank_pattern and alpha_pattern
    assert spec.modules[(0, "v_proj")].scaling == 3 / 2
    rs = check_adapter("b", str(rslora_dir), shape, max_rank=8)
    assert set(rs.modules) == {(i, m) for i in (0, 1) for m in ("o_proj", "down_proj")}
    assert rs.modules[(0, "o_proj")].scaling == pytest.approx(4 / math.sqrt(8))  # rsLoRA


def test_b_has_peft_scaling_folded_in(tiny_dir: Path, adapter_dir: Path) -> None:
    adapter = load_adapter("a", str(adapter_dir), _shape(tiny_dir), max_rank=8)
    reference = peft_model(str(tiny_dir), str(adapter_dir))
    for layer, module in [(0, "v_proj"), (1, "gate_proj"), (1, "o_proj")]:
        parent = "self_attn" if module[0] in "qkvo" else "mlp"
        peft_layer = reference.get_submodule(f"base_model.model.model.layers.{layer}")
        peft_layer = peft_layer.get_submodule(f"{parent}.{module}")
        a, b = adapter.weights[(layer, module)]
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, peft_layer.lora_A["default"].weight)
        scaled = peft_layer.lora_B["default"].weight * peft_layer.scaling["default"]
        torch.testing.assert_close(b, scaled)


def test_the_weights_hash_follows_config_and_weights(
    tmp_path: Path, tiny_dir: Path, adapter_dir: Path
) -> None:
    shape = _shape(tiny_dir)
    first = check_adapter("a", str(adapter_dir), shape, 8).weights_hash
    assert check_adapter("other name", str(adapter_dir), shape, 8).weights_hash == first
    changed = _copy(adapter_dir, tmp_path)
    tensors = load_file(changed / WEIGHTS_FILE)
    tensors[f"{PREFIX}.0.self_attn.q_proj.lora_B.weight"] += 1e-3
    save_file(tensors, changed / WEIGHTS_FILE)
    assert check_adapter("a", str(changed), shape, 8).weights_hash != first
    _edit_config(adapter_dir, tmp_path / "alpha", lora_alpha=9)
    assert check_adapter("a", str(tmp_path / "alpha"), shape, 8).weights_hash != first


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, dirs_exist_ok=True)
    return dst


def _edit_config(src: Path, dst: Path, **fields: Any) -> Path:
    _copy(src, dst)
    config = json.loads((dst / CONFIG_FILE).read_text())
    config.update(fields)
    (dst / CONFIG_FILE).write_text(json.dumps(config))
    return dst


def _edit_tensors(src: Path, dst: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    _copy(src, dst)
    tensors = load_file(dst / WEIGHTS_FILE)
    change(tensors)
    save_file(tensors, dst / WEIGHTS_FILE)
    return dst


def _broken(case: str, src: Path, dst: Path) -> Path:
    """A copy of the adapter at `src` broken the way `case` says."""
    q = f"{PREFIX}.0.self_attn.q_proj"
    if case == "malformed json":
        _copy(src, dst)
        (dst / CONFIG_FILE).write_text('{"r": 4, "lora_alpha": ')
    elif case == "missing config":
        _copy(src, dst)
        (dst / CONFIG_FILE).unlink()
    elif case == "missing safetensors":
        _copy(src, dst)
        (dst / WEIGHTS_FILE).unlink()
    elif case == "pickled weights":
        _copy(src, dst)
        (dst / WEIGHTS_FILE).rename(dst / "adapter_model.bin")
    elif case == "not safetensors":
        _copy(src, dst)
        (dst / WEIGHTS_FILE).write_bytes(b"\xff" * 64)
    elif case == "rank above the limit":
        _edit_config(src, dst, r=32)
    elif case == "unknown target":
        _edit_config(src, dst, target_modules=["q_proj", "lm_head"])
    elif case == "embedding tensor":
        _edit_tensors(
            src,
            dst,
            lambda t: t.update(
                {"base_model.model.model.embed_tokens.lora_A.weight": torch.zeros(4, 64)}
            ),
        )
    elif case == "wrong shape":
        _edit_tensors(src, dst, lambda t: t.update({q + ".lora_B.weight": torch.zeros(63, 4)}))
    elif case == "missing B":
        _edit_tensors(src, dst, lambda t: t.pop(q + ".lora_B.weight"))
    elif case == "layer out of range":
        _edit_tensors(
            src,
            dst,
            lambda t: t.update(
                {k.replace("layers.1.", "layers.7."): v.clone() for k, v in t.items()}
            ),
        )
    elif case in ("use_dora", "modules_to_save", "bias", "r"):
        value = {"use_dora": True, "modules_to_save": ["lm_head"], "bias": "all", "r": "4"}
        _edit_config(src, dst, **{case: value[case]})
    else:
        raise AssertionError(case)
    return dst


# case -> (the file named, words of the message: the field or tensor)
BROKEN = {
    "malformed json": (CONFIG_FILE, "not valid JSON"),
    "missing config": (CONFIG_FILE, "missing"),
    "missing safetensors": (WEIGHTS_FILE, "missing"),
    "pickled weights": ("adapter_model.bin", "safe_serialization=True"),
    "not safetensors": (WEIGHTS_FILE, "not a safetensors file"),
    "rank above the limit": (CONFIG_FILE, "field 'r'"),
    "unknown target": (CONFIG_FILE, "field 'target_modules' names 'lm_head'"),
    "embedding tensor": (WEIGHTS_FILE, "tensor 'base_model.model.model.embed_tokens"),
    "wrong shape": (WEIGHTS_FILE, "layers.0.self_attn.q_proj.lora_B.weight' has shape [63, 4]"),
    "missing B": (WEIGHTS_FILE, "layers.0.self_attn.q_proj.lora_B' missing"),
    "layer out of range": (WEIGHTS_FILE, "layer 7, the model has 2"),
    "use_dora": (CONFIG_FILE, "field 'use_dora'"),
    "modules_to_save": (CONFIG_FILE, "field 'modules_to_save'"),
    "bias": (CONFIG_FILE, "field 'bias'"),
    "r": (CONFIG_FILE, "field 'r'"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_bad_adapter_is_refused_naming_the_file_and_field(
    case: str, tmp_path: Path, tiny_dir: Path, adapter_dir: Path
) -> None:
    folder = _broken(case, adapter_dir, tmp_path / "adapter")
    file, words = BROKEN[case]
    with pytest.raises(LoraAdapterError) as error:
        load_adapter("a", str(folder), _shape(tiny_dir), max_rank=8)
    assert str(folder / file) in str(error.value) and words in str(error.value), error.value


def test_an_adapter_of_another_model_is_refused_by_shape(adapter_dir: Path) -> None:
    wider = ModelShape(num_layers=2, hidden_size=128, q_size=128, kv_size=64, intermediate_size=160)
    with pytest.raises(LoraAdapterError, match=r"down_proj.lora_B.weight. has shape \[64, 4\]"):
        check_adapter("a", str(adapter_dir), wider, max_rank=8)


def test_a_regex_target_reads_the_modules_it_matched(tmp_path: Path, tiny_dir: Path) -> None:
    from tests.lora_adapters import make_adapter

    folder = make_adapter(
        tiny_dir, tmp_path / "re", r=2, target_modules=r".*\.1\.mlp\.(up|down)_proj", seed=3
    )
    spec = check_adapter("re", str(folder), _shape(tiny_dir), max_rank=8)
    assert set(spec.modules) == {(1, "up_proj"), (1, "down_proj")}


@pytest.mark.parametrize("module", ["q_proj", "k_proj", "gate_proj", "o_proj", "down_proj"])
def test_shards_sum_or_stack_to_the_whole_delta(module: str) -> None:
    """Column-parallel modules: each rank's output rows; row-parallel ones: partial sums of
    the sharded input (the layer's all-reduce adds them)."""
    torch.manual_seed(0)
    world, n_in, n_out, rank = 2, 12, 8, 3
    a, b = torch.randn(rank, n_in), torch.randn(n_out, rank)
    x = torch.randn(5, n_in)
    whole = x @ a.T @ b.T
    parts = [shard_module(module, a, b, r, world) for r in range(world)]
    if module in ("o_proj", "down_proj"):
        xs = x.chunk(world, dim=1)
        got = sum(xs[r] @ pa.T @ pb.T for r, (pa, pb) in enumerate(parts))
    else:
        got = torch.cat([x @ pa.T @ pb.T for pa, pb in parts], dim=1)
    torch.testing.assert_close(got, whole)
