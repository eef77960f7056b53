"""Adapters in memory (gpu_worker/lora/manager.py): the host LRU cache, each version's slots
(LRU among the resident, filled in the fused layout), the step's token mapping, and the
one-call step kept off steps with adapter rows. On a real tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu_worker.attention import AttentionMetadata
from gpu_worker.lora.adapter import WEIGHTS_FILE, LoraAdapterError
from gpu_worker.lora.layer import LoraLinearMethod, LoraMapping
from gpu_worker.lora.manager import LoraManager, SkipWhenLoraActive
from gpu_worker.models.llama import LlamaModel
from gpu_worker.runner.model_runner import ModelRunner
from gpu_worker.runner.options import RunnerOptions
from tests.lora_adapters import lora_config, make_adapter
from tests.tiny_models import make_tiny_model


def _runner(tiny_dir: Path, **options: int) -> ModelRunner:
    opts = lora_config(**{"max_loras": 2, "max_lora_rank": 8, **options})
    return ModelRunner(str(tiny_dir), RunnerOptions(block_size=4, num_blocks=8, lora=opts))


def _manager(runner: ModelRunner) -> LoraManager:
    assert runner.lora is not None
    return runner.lora


def _method(runner: ModelRunner, layer: int, fused: str) -> LoraLinearMethod:
    parent = "self_attn" if fused in ("qkv_proj", "o_proj") else "mlp"
    method = runner.model.get_submodule(f"model.layers.{layer}.{parent}.{fused}").method
    assert isinstance(method, LoraLinearMethod)
    return method


@pytest.fixture
def third_dir(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Path:
    return make_adapter(tiny_dir, tmp_path_factory.mktemp("c") / "c", r=2, seed=5)


def test_a_step_maps_each_token_to_its_adapters_slot(
    tiny_dir: Path, adapter_dir: Path, rslora_dir: Path
) -> None:
    runner = _runner(tiny_dir)
    lora = _manager(runner)
    lora.load("a", str(adapter_dir))
    lora.load("b", str(rslora_dir))
    lora.set_step(runner.model, [("a", 2), ("", 1), ("b", 3)])
    slots = lora.slots(runner.model)
    mapping = slots.mapping
    sa = slots.resident[("a", lora.registry.spec("a").weights_hash)]
    sb = slots.resident[("b", lora.registry.spec("b").weights_hash)]
    assert mapping.active and mapping.token_slots.tolist() == [sa, sa, -1, sb, sb, sb]
    lora.set_step(runner.model, [("", 4)])
    assert not mapping.active


def test_slots_hold_the_adapter_in_the_fused_layout(
    tiny_dir: Path, adapter_dir: Path, rslora_dir: Path
) -> None:
    runner = _runner(tiny_dir)
    lora = _manager(runner)
    a = lora.adapter(lora.load("a", str(adapter_dir)).name)
    b = lora.adapter(lora.load("b", str(rslora_dir)).name)
    lora.set_step(runner.model, [("a", 1), ("b", 1)])
    sa, sb = lora.slots(runner.model).mapping.token_slots.tolist()
    qkv = _method(runner, 1, "qkv_proj")  # q 64 | k 32 | v 32, v of rank 2
    a_v, b_v = a.weights[(1, "v_proj")]
    torch.testing.assert_close(qkv.lora_a[sa, 2, :2], a_v)
    torch.testing.assert_close(qkv.lora_b[sa, 96:128, :2], b_v)
    assert not qkv.lora_a[sa, 2, 2:].any() and not qkv.lora_b[sa, 96:128, 2:].any()
    a_q, b_q = a.weights[(1, "q_proj")]
    torch.testing.assert_close(qkv.lora_b[sa, 0:64, :4], b_q)
    torch.testing.assert_close(qkv.lora_a[sa, 0, :4], a_q)
    gate_up = _method(runner, 0, "gate_up_proj")
    torch.testing.assert_close(gate_up.lora_b[sa, 160:320, :4], a.weights[(0, "up_proj")][1])
    assert not qkv.lora_a[sb].any() and not qkv.lora_b[sb].any()  # b targets o and down only
    down = _method(runner, 0, "down_proj")
    torch.testing.assert_close(down.lora_b[sb, :, :8], b.weights[(0, "down_proj")][1])


def test_slots_are_reused_least_recently_used_first(
    tiny_dir: Path, adapter_dir: Path, rslora_dir: Path, third_dir: Path
) -> None:
    runner = _runner(tiny_dir)
    lora = _manager(runner)
    for name, folder in (("a", adapter_dir), ("b", rslora_dir), ("c", third_dir)):
        lora.load(name, str(folder))
    slots = lora.slots(runner.model)

    def slot_of() -> dict[str, int]:
        return {name: slot for (name, _), slot in slots.resident.items()}

    lora.set_step(runner.model, [("a", 1), ("b", 1)])
    first = slot_of()
    lora.set_step(runner.model, [("b", 1), ("c", 1)])  # a is not in the step: c takes its slot
    assert slot_of() == {"b": first["b"], "c": first["a"]}
    lora.set_step(runner.model, [("c", 1)])
    lora.set_step(runner.model, [("a", 1)])  # b used least recently
    assert slot_of() == {"c": first["a"], "a": first["b"]}
    with pytest.raises(ValueError, match="more than --max-loras 2"):
        lora.set_step(runner.model, [("a", 1), ("b", 1), ("c", 1)])


def test_the_host_cache_rereads_evicted_adapters_and_refuses_changed_files(
    tmp_path: Path, tiny_dir: Path, adapter_dir: Path, rslora_dir: Path, third_dir: Path
) -> None:
    runner = _runner(tiny_dir, max_cpu_loras=2)
    lora = _manager(runner)
    moved = tmp_path / "a"
    moved.mkdir()
    for file in adapter_dir.iterdir():
        (moved / file.name).write_bytes(file.read_bytes())
    kept = lora.adapter(lora.load("a", str(moved)).name)
    lora.load("b", str(rslora_dir))
    lora.load("c", str(third_dir))
    assert list(lora.cache) == ["b", "c"]  # a evicted, still loaded
    again = lora.adapter("a")
    torch.testing.assert_close(again.weights[(0, "q_proj")], kept.weights[(0, "q_proj")])
    assert list(lora.cache) == ["c", "a"]
    lora.adapter("b")  # evicts c, then a
    lora.adapter("c")
    tensors = load_file(moved / WEIGHTS_FILE)
    tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"] *= 2
    save_file(tensors, moved / WEIGHTS_FILE)
    with pytest.raises(LoraAdapterError, match="changed on disk since it was loaded"):
        lora.set_step(runner.model, [("a", 1)])


def test_reload_recopies_and_unload_frees_the_slot(
    tiny_dir: Path, adapter_dir: Path, third_dir: Path
) -> None:
    runner = _runner(tiny_dir)
    lora = _manager(runner)
    lora.load("a", str(adapter_dir))
    lora.set_step(runner.model, [("a", 1)])
    qkv = _method(runner, 0, "qkv_proj")
    (slot,) = lora.slots(runner.model).mapping.token_slots.tolist()
    before = qkv.lora_b[slot].clone()
    lora.load("a", str(third_dir))  # the same name, other weights
    lora.set_step(runner.model, [("a", 1)])
    (slot,) = lora.slots(runner.model).mapping.token_slots.tolist()
    assert not torch.equal(qkv.lora_b[slot], before)
    torch.testing.assert_close(qkv.lora_a[slot, 0, :2], lora.adapter("a").weights[(0, "q_proj")][0])
    lora.unload("a")
    assert not lora.slots(runner.model).resident and "a" not in lora.cache
    with pytest.raises(LoraAdapterError, match="'a' is not loaded"):
        lora.set_step(runner.model, [("a", 1)])
    with pytest.raises(KeyError, match="'a' is not loaded"):
        lora.unload("a")


def test_an_adapter_that_does_not_fit_a_version_is_refused_for_it(
    tmp_path: Path, tiny_dir: Path, adapter_dir: Path
) -> None:
    runner = _runner(tiny_dir)
    lora = _manager(runner)
    lora.load("a", str(adapter_dir))
    other = ModelRunner(
        str(make_tiny_model(tmp_path / "qwen3", "qwen3")), RunnerOptions(num_blocks=8)
    )
    lora.attach(other.model, max_tokens=16)  # q is 4 heads x 32 there, 4 x 16 here
    with pytest.raises(LoraAdapterError, match="does not fit this model version"):
        lora.set_step(other.model, [("a", 1)])
    assert not lora.slots(other.model).resident and len(lora.slots(other.model).free) == 2
    lora.set_step(runner.model, [("a", 1)])  # the version it fits still takes it


class _Recorder:
    """A stand-in one-call step (the C step needs a built kernel): records its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def forward(
        self,
        model: LlamaModel,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor | None:
        self.calls += 1
        return input_ids


def test_the_one_call_step_runs_only_steps_without_adapter_rows(tiny_dir: Path) -> None:
    runner = _runner(tiny_dir)
    # guarded unless the C step adds the deltas itself (the "cpu" LoRA kernel)
    guarded = isinstance(runner.model.model.one_call_step, SkipWhenLoraActive)
    assert guarded == (_method(runner, 0, "qkv_proj").kernel != "cpu")
    mapping = LoraMapping(4, torch.device("cpu"))
    inner = _Recorder()
    step = SkipWhenLoraActive(inner, mapping)
    ids = torch.tensor([1, 2])
    args = (runner.model.model, ids, ids, torch.empty(0), None)
    mapping.set([-1, -1])
    assert step.forward(*args) is ids  # type: ignore[arg-type]
    mapping.set([-1, 0])
    assert step.forward(*args) is None and inner.calls == 1  # type: ignore[arg-type]


def test_loading_the_same_files_again_keeps_the_slot(tiny_dir: Path, adapter_dir: Path) -> None:
    runner = _runner(tiny_dir)
    lora = _manager(runner)
    spec = lora.load("a", str(adapter_dir))
    lora.set_step(runner.model, [("a", 1)])
    resident = dict(lora.slots(runner.model).resident)
    assert lora.load("a", str(adapter_dir)) == spec  # the scheduler's LoadLora at start
    assert dict(lora.slots(runner.model).resident) == resident


def test_lora_dtype_bfloat16_keeps_the_slots_in_bfloat16_with_the_adapters_values(
    tiny_dir: Path, adapter_dir: Path
) -> None:
    wide = _runner(tiny_dir)
    half = ModelRunner(
        str(tiny_dir),
        RunnerOptions(
            block_size=4,
            num_blocks=8,
            lora=lora_config(max_loras=2, max_lora_rank=8, lora_dtype="bfloat16"),
        ),
    )
    for runner in (wide, half):
        _manager(runner).load("a", str(adapter_dir))
        _manager(runner).set_step(runner.model, [("a", 1)])
    full, low = _method(wide, 0, "qkv_proj"), _method(half, 0, "qkv_proj")
    assert full.lora_a.dtype == torch.float32 and low.lora_a.dtype == torch.bfloat16
    assert low.lora_b.dtype == torch.bfloat16
    # the same slot holds the float32 adapter rounded to bfloat16 once
    assert torch.equal(low.lora_a, full.lora_a.to(torch.bfloat16))
    assert torch.equal(low.lora_b, full.lora_b.to(torch.bfloat16))
