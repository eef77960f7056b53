"""The one-call decode step (gpu_worker/cpu/decode_step.py, read from the model by
gpu_worker/cpu/one_call_step.py) against the layer-by-layer path it replaces: the same
kernels in the same order, so the same hidden states bit for bit and the same K/V written,
for every batch size it takes and on the models it takes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_worker.attention.metadata import build_metadata
from gpu_worker.attention.torch_backend import TorchAttentionBackend
from gpu_worker.cpu import decode_step, one_call_step
from gpu_worker.cpu.linear import MAX_ROWS
from gpu_worker.layers.kernel_choice import KernelChoice, choose_kernels
from gpu_worker.model_loader.hf_folder import read_hf_config
from gpu_worker.model_loader.loader import load_model
from gpu_worker.models.llama import LlamaForCausalLM
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.skipif(decode_step.load() is None, reason="no C compiler here")

BLOCK_SIZE, NUM_BLOCKS = 4, 64


def _model(
    folder: Path, *, cpu_layers: bool = True, dtype: torch.dtype = torch.float32
) -> LlamaForCausalLM:
    cfg = read_hf_config(folder)
    heads = cfg["num_attention_heads"]
    backend = TorchAttentionBackend(
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    cpu = torch.device("cpu")
    kernels = (
        choose_kernels(device=cpu, backend_name="torch", dtype=dtype)
        if cpu_layers
        else KernelChoice(dtype=dtype)
    )
    return load_model(folder, backend, dtype=dtype, device=cpu, max_positions=256, kernels=kernels)


def _layer_by_layer(model: LlamaForCausalLM, *args: torch.Tensor) -> torch.Tensor:
    """The model's forward with its layers one by one (no one-call step)."""
    step, model.model.decode_step = model.model.decode_step, None
    try:
        return model.model(*args)
    finally:
        model.model.decode_step = step


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("decode-step")
    return {arch: make_tiny_model(root / arch, arch, num_layers=3) for arch in ("llama", "qwen2")}


def _step(model: LlamaForCausalLM, n: int, seed: int) -> tuple[torch.Tensor, ...]:
    """A decode step of n sequences of different lengths over a randomly filled cache."""
    gen = torch.Generator().manual_seed(seed)
    inner = model.model
    attn = inner.layers[0].self_attn
    kv = torch.randn(
        len(inner.layers), 2, NUM_BLOCKS, BLOCK_SIZE, attn.num_kv_heads, attn.head_dim,
        generator=gen,
    ).to(attn.qkv_proj.weight.dtype)  # fmt: skip
    computed = [int(c) for c in torch.randint(0, 40, (n,), generator=gen)]
    blocks = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables = []
    for c in computed:  # scattered blocks, enough for the new token
        need = c // BLOCK_SIZE + 1
        tables.append(blocks[:need])
        blocks = blocks[need:]
    meta = attn.backend.build_metadata(build_metadata(computed, [1] * n, tables, BLOCK_SIZE))
    ids = torch.randint(0, model.config.vocab_size, (n,), generator=gen)
    return ids, kv, meta  # type: ignore[return-value]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_one_call_equals_the_layers_bit_for_bit(tiny: dict[str, Path], arch: str, n: int) -> None:
    model = _model(tiny[arch])
    assert isinstance(model.model.decode_step, one_call_step.CpuDecodeStep)
    ids, kv, meta = _step(model, n, seed=n)
    kv_layers = kv.clone()
    with torch.inference_mode():
        expected = _layer_by_layer(model, ids, meta.positions, kv_layers, meta)
        got = model.model(ids, meta.positions, kv, meta)
    assert torch.equal(got, expected)
    assert torch.equal(kv, kv_layers)  # the new tokens' K/V stored alike, nothing else touched


@pytest.mark.parametrize("n", [1, 4])
def test_bfloat16_within_bf16_precision(tiny: dict[str, Path], n: int) -> None:
    """Activations stay float32 inside the C loop, where torch's bf16 layers round each op:
    the step is within bf16's precision of both the bf16 layers and the float32 model on the
    same (bf16-rounded) weights, and K/V land in the new tokens' slots only."""
    model = _model(tiny["qwen2"], dtype=torch.bfloat16)
    assert model.model.decode_step is not None
    exact = _model(tiny["qwen2"])
    with torch.no_grad():
        for p32, p16 in zip(exact.parameters(), model.parameters(), strict=True):
            p32.copy_(p16.float())
    ids, kv, meta = _step(model, n, seed=10 + n)
    kv_layers, kv_exact = kv.clone(), kv.float()
    with torch.inference_mode():
        layers = _layer_by_layer(model, ids, meta.positions, kv_layers, meta).float()
        reference = _layer_by_layer(exact, ids, meta.positions, kv_exact, meta)
        got = model.model(ids, meta.positions, kv, meta)
    assert got.dtype == torch.bfloat16
    scale = reference.abs().max()
    assert (got.float() - reference).abs().max() <= 0.015 * scale  # measured 0.005-0.008
    assert (got.float() - layers).abs().max() <= 0.05 * scale  # measured 0.012-0.02
    slots = set(meta.slot_mapping.tolist())
    changed = (kv != kv_layers).any(dim=-1).any(dim=-1).nonzero().tolist()
    assert all(b * BLOCK_SIZE + o in slots for _, _, b, o in changed)
    torch.testing.assert_close(kv.float(), kv_layers.float(), rtol=0.05, atol=0.05)


def test_prefill_and_large_batches_take_the_layers(tiny: dict[str, Path]) -> None:
    model = _model(tiny["llama"])
    assert model.model.decode_step is not None
    calls = []
    lib = decode_step.load()
    assert lib is not None
    original = lib.decode_forward
    try:
        lib.decode_forward = lambda *a: calls.append(a) or original(*a)
        for n in (MAX_ROWS[torch.float32] + 1, 3):
            ids, kv, meta = _step(model, n, seed=0)
            with torch.inference_mode():
                model.model(ids, meta.positions, kv, meta)
        backend = model.model.layers[0].self_attn.backend
        prefill = backend.build_metadata(build_metadata([0], [6], [[0, 1]], BLOCK_SIZE))
        with torch.inference_mode():
            model.model(torch.arange(6), prefill.positions, kv, prefill)
    finally:
        lib.decode_forward = original
    assert len(calls) == 1  # only the 3-sequence decode step


def test_only_models_it_takes_get_it(tiny: dict[str, Path], tmp_path: Path) -> None:
    plain = _model(tiny["llama"], cpu_layers=False)  # torch layers: not the kernels' shape
    assert plain.model.decode_step is None and one_call_step.decode_step_for(plain) is None
    qk_norm = _model(make_tiny_model(tmp_path / "qwen3", "qwen3", num_layers=1))
    assert qk_norm.model.decode_step is None
