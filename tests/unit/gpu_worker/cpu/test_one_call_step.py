"""The one-call decode step with LoRA adapters (gpu_worker/cpu/one_call_step.py, with
lora.c inside decode_step.c) against the layer-by-layer path with the "cpu" LoRA kernel: the
same hidden states bit for bit and the same K/V, for decode steps that mix adapters and the
base model; and the layer path against the contract's torch reference. (The one-call step
without LoRA: tests/unit/gpu_worker/cpu/test_decode_step.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_worker.cpu import decode_step, one_call_step
from gpu_worker.lora.layer import LoraLinearMethod, LoraMapping, enable_lora, lora_layers
from gpu_worker.models.llama import LlamaForCausalLM
from tests.tiny_models import make_tiny_model
from tests.unit.gpu_worker.cpu.test_decode_step import _layer_by_layer, _model, _step

pytestmark = pytest.mark.skipif(decode_step.load() is None, reason="no C compiler here")

MAX_LORAS, MAX_RANK = 4, 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("one-call-lora")
    return {arch: make_tiny_model(root / arch, arch, num_layers=3) for arch in ("llama", "qwen2")}


def _with_adapters(model: LlamaForCausalLM, seed: int, kernel: str = "cpu") -> LoraMapping:
    """LoRA on every target, slots filled with random numbers (slot 2 left empty, slot 3 an
    adapter of rank 3 of MAX_RANK), large enough to change the outputs."""
    mapping = enable_lora(
        model, max_loras=MAX_LORAS, max_rank=MAX_RANK, max_tokens=8, kernel=kernel
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer, _ in lora_layers(model):
            method = layer.method
            assert isinstance(method, LoraLinearMethod)
            a, b = method.lora_a, method.lora_b
            a.copy_(torch.randn(a.shape, generator=gen).to(a.dtype) * 0.3)
            b.copy_(torch.randn(b.shape, generator=gen).to(b.dtype) * 0.3)
            a[2], b[2] = 0, 0
            a[3, :, 3:], b[3, :, 3:] = 0, 0
    return mapping


def _one_call(model: LlamaForCausalLM, *args: torch.Tensor) -> torch.Tensor:
    """The model's forward, asserting that the one-call step ran it."""
    lib = decode_step.load()
    assert lib is not None
    calls, original = [], lib.decode_forward
    try:
        lib.decode_forward = lambda *a: calls.append(a) or original(*a)
        with torch.inference_mode():
            out = model.model(*args)
    finally:
        lib.decode_forward = original
    assert len(calls) == 1
    return out


def _slots(n: int) -> list[int]:
    return [(i % (MAX_LORAS + 1)) - 1 for i in range(1, n + 1)]  # 0, 1, 2, 3, -1, 0, ...


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("n", [1, 3, 5, 8])
def test_one_call_with_lora_equals_the_layers_bit_for_bit(
    tiny: dict[str, Path], arch: str, n: int
) -> None:
    model = _model(tiny[arch])
    ids, kv, meta = _step(model, n, seed=n)
    with torch.inference_mode():  # a step before LoRA: the step's pointers are rebuilt after
        base = model.model(ids, meta.positions, kv.clone(), meta)
    mapping = _with_adapters(model, seed=n)
    assert isinstance(model.model.decode_step, one_call_step.CpuDecodeStep)
    mapping.set(_slots(n))
    kv_layers = kv.clone()
    with torch.inference_mode():
        expected = _layer_by_layer(model, ids, meta.positions, kv_layers, meta)
    got = _one_call(model, ids, meta.positions, kv, meta)
    assert torch.equal(got, expected)
    assert torch.equal(kv, kv_layers)
    changed = (got != base).any(dim=-1).tolist()
    assert changed == [s in (0, 1, 3) for s in _slots(n)]  # adapters change their rows only


def test_no_active_adapter_is_the_base_step(tiny: dict[str, Path]) -> None:
    model = _model(tiny["llama"])
    ids, kv, meta = _step(model, 4, seed=1)
    with torch.inference_mode():
        base = model.model(ids, meta.positions, kv.clone(), meta)
        mapping = _with_adapters(model, seed=1)
        mapping.set([-1] * 4)
    assert not mapping.active
    assert torch.equal(_one_call(model, ids, meta.positions, kv.clone(), meta), base)


def test_layer_kernel_matches_the_reference(tiny: dict[str, Path]) -> None:
    """A prefill of mixed adapters through the layers: the "cpu" kernel against "torch"."""
    from gpu_worker.attention.metadata import build_metadata

    logits = []
    for kernel in ("cpu", "torch"):
        model = _model(tiny["qwen2"])
        mapping = _with_adapters(model, seed=5, kernel=kernel)
        backend = model.model.layers[0].self_attn.backend
        meta = backend.build_metadata(build_metadata([0, 0], [5, 7], [[0, 1], [2, 3]], 4))
        _, kv, _ = _step(model, 1, seed=0)
        mapping.set([1] * 5 + [3] * 7)
        with torch.inference_mode():
            logits.append(model.model(torch.arange(12), meta.positions, kv, meta))
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)


def test_bfloat16_model_with_lora_within_bf16_precision(tiny: dict[str, Path]) -> None:
    model = _model(tiny["qwen2"], dtype=torch.bfloat16)
    mapping = _with_adapters(model, seed=9)
    ids, kv, meta = _step(model, 4, seed=9)
    mapping.set(_slots(4))
    kv_layers = kv.clone()
    with torch.inference_mode():
        layers = _layer_by_layer(model, ids, meta.positions, kv_layers, meta).float()
    got = _one_call(model, ids, meta.positions, kv, meta)
    assert got.dtype == torch.bfloat16
    assert (got.float() - layers).abs().max() <= 0.05 * layers.abs().max()


def test_torch_lora_kernel_keeps_the_layers(tiny: dict[str, Path], tmp_path: Path) -> None:
    """LoRA layers on the reference kernel: the step is not taken (its arithmetic is lora.c's)."""
    model = _model(tiny["llama"])
    _with_adapters(model, seed=0, kernel="torch")
    assert not one_call_step.can_use(model)
