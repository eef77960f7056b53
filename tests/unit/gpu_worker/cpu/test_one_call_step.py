"""The one-call step (gpu_worker/cpu/one_call_step.py, one_call_step.c) against the
layer-by-layer path it replaces: the same kernels in the same order, so the same hidden states
bit for bit and the same K/V written, for every batch size it takes and on the models it
takes (Phi-4-mini's partial rotary among them); with LoRA adapters (lora.c inside
one_call_step.c) against the layers with the "cpu" LoRA kernel, for decode steps that mix
adapters and the base model, and the layer path against the contract's torch reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gpu_worker.attention.metadata import build_metadata
from gpu_worker.attention.torch_backend import TorchAttentionBackend
from gpu_worker.cpu import one_call_step
from gpu_worker.cpu.linear import MAX_ROWS
from gpu_worker.layers.kernel_choice import KernelChoice, choose_kernels
from gpu_worker.lora.layer import LoraLinearMethod, LoraMapping, enable_lora, lora_layers
from gpu_worker.model_loader.hf_folder import read_hf_config
from gpu_worker.model_loader.loader import load_model
from gpu_worker.models.llama import LlamaForCausalLM
from gpu_worker.models.llama_config import LlamaConfig
from tests.gguf_models import make_tiny_k_model, write_gguf
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.skipif(one_call_step.load() is None, reason="no C compiler here")

BLOCK_SIZE, NUM_BLOCKS = 4, 64
MAX_LORAS, MAX_RANK = 4, 8


def _model(
    folder: Path,
    *,
    cpu_layers: bool = True,
    dtype: torch.dtype = torch.float32,
    kv_cache_dtype: str = "auto",
) -> LlamaForCausalLM:
    cfg, cpu = LlamaConfig.from_hf(read_hf_config(folder)), torch.device("cpu")
    heads = {"num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads}
    backend = TorchAttentionBackend(
        **heads, head_dim=cfg.head_dim, dtype=dtype, device=cpu, kv_cache_dtype=kv_cache_dtype
    )
    kernels = (
        choose_kernels(device=cpu, backend_name="torch", dtype=dtype)
        if cpu_layers
        else KernelChoice(dtype=dtype)
    )
    return load_model(folder, backend, dtype=dtype, device=cpu, max_positions=256, kernels=kernels)


def _layer_by_layer(model: LlamaForCausalLM, *args: torch.Tensor) -> torch.Tensor:
    """The model's forward with its layers one by one (no one-call step)."""
    step, model.model.one_call_step = model.model.one_call_step, None
    try:
        return model.model(*args)
    finally:
        model.model.one_call_step = step


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("one-call-step")
    archs = ("llama", "qwen2", "qwen3", "phi4-mini")  # phi4-mini: 12 of each 16-dim head rotate
    return {arch: make_tiny_model(root / arch, arch, num_layers=3) for arch in archs}


def _step(
    model: LlamaForCausalLM, n: int, seed: int, num_blocks: int = NUM_BLOCKS
) -> tuple[torch.Tensor, ...]:
    """A decode step of n sequences of different lengths over a randomly filled cache (of
    num_blocks blocks: up to 11 a sequence)."""
    gen = torch.Generator().manual_seed(seed)
    inner = model.model
    attn = inner.layers[0].self_attn
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    kv = torch.randn(
        len(inner.layers), 2, num_blocks, BLOCK_SIZE, attn.num_kv_heads, attn.head_dim,
        generator=gen,
    ).to(dtype)  # fmt: skip
    kv = attn.backend.kv_format.quantize(kv)  # a quantized cache's rows (auto: as it is)
    computed = [int(c) for c in torch.randint(0, 40, (n,), generator=gen)]
    blocks = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for c in computed:  # scattered blocks, enough for the new token
        need = c // BLOCK_SIZE + 1
        tables.append(blocks[:need])
        blocks = blocks[need:]
    meta = attn.backend.build_metadata(build_metadata(computed, [1] * n, tables, BLOCK_SIZE))
    ids = torch.randint(0, model.config.vocab_size, (n,), generator=gen)
    return ids, kv, meta  # type: ignore[return-value]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi4-mini"])
@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_one_call_equals_the_layers_bit_for_bit(tiny: dict[str, Path], arch: str, n: int) -> None:
    model = _model(tiny[arch])
    assert isinstance(model.model.one_call_step, one_call_step.OneCallStep)
    ids, kv, meta = _step(model, n, seed=n)
    kv_layers = kv.clone()
    with torch.inference_mode():
        expected = _layer_by_layer(model, ids, meta.positions, kv_layers, meta)
        got = model.model(ids, meta.positions, kv, meta)
    assert torch.equal(got, expected)
    assert torch.equal(kv, kv_layers)  # the new tokens' K/V stored alike, nothing else touched


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("n", [1, 5])
def test_quantized_kv_equals_the_layers_bit_for_bit(
    tiny: dict[str, Path], kv_cache_dtype: str, n: int
) -> None:
    """With a quantized cache the C loop quantizes each new row as the torch backend does
    (the same bits stored) and attends over the rows as stored."""
    model = _model(tiny["llama"], kv_cache_dtype=kv_cache_dtype)
    ids, kv, meta = _step(model, n, seed=10 + n)
    assert kv.dtype in (torch.int8, torch.uint8)
    kv_layers = kv.clone()
    with torch.inference_mode():
        expected = _layer_by_layer(model, ids, meta.positions, kv_layers, meta)
        got = model.model(ids, meta.positions, kv, meta)
    assert torch.equal(got, expected)
    assert torch.equal(kv, kv_layers)  # the new rows quantized to the same bits
    step = model.model.one_call_step
    assert step is not None
    with torch.inference_mode():  # and the C loop took the step (it did not fall back)
        assert step.forward(model.model, ids, meta.positions, kv.clone(), meta) is not None


@pytest.mark.parametrize("n", [1, 4])
def test_bfloat16_within_bf16_precision(tiny: dict[str, Path], n: int) -> None:
    """Activations stay float32 inside the C loop, where torch's bf16 layers round each op:
    the step is within bf16's precision of both the bf16 layers and the float32 model on the
    same (bf16-rounded) weights, and K/V land in the new tokens' slots only."""
    model = _model(tiny["qwen2"], dtype=torch.bfloat16)
    assert model.model.one_call_step is not None
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


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Llama (hidden 256: K-quants' rows) written with every matrix in each type."""
    root = tmp_path_factory.mktemp("one-call-gguf")
    folder = make_tiny_k_model(root / "k")
    files = {}
    for qtype in (Q.Q4_1, Q.Q8_0, Q.Q4_K):
        files[qtype.name] = root / f"k-{qtype.name}.gguf"
        write_gguf(folder, files[qtype.name], qtype)
    return files


@pytest.mark.parametrize(("qtype", "n"), [("Q4_1", 9), ("Q4_1", 40), ("Q8_0", 33), ("Q4_K", 12)])
def test_gguf_models_take_more_rows_bit_for_bit(
    gguf_files: dict[str, Path], qtype: str, n: int
) -> None:
    """Every linear GGUF blocks: the step takes more than linear.MAX_ROWS sequences, each
    linear on the kernel the layers pick for the row count (the int8 GEMM past the few-row
    kernel's 8 rows, 16 where the GEMM runs on AMX tiles; K-quants' few-row kernel for any
    rows), the same bits as the layers."""
    model = _model(gguf_files[qtype])
    step = model.model.one_call_step
    assert isinstance(step, one_call_step.OneCallStep)
    assert n > MAX_ROWS[torch.float32]
    ids, kv, meta = _step(model, n, seed=30 + n, num_blocks=11 * n)
    kv_layers = kv.clone()
    with torch.inference_mode():
        expected = _layer_by_layer(model, ids, meta.positions, kv_layers, meta)
        took = step.forward(model.model, ids, meta.positions, kv.clone(), meta)
        got = model.model(ids, meta.positions, kv, meta)
    assert took is not None  # the C loop took the step (it did not fall back)
    assert torch.equal(got, expected)
    assert torch.equal(kv, kv_layers)


def test_prefill_and_large_batches_take_the_layers(tiny: dict[str, Path]) -> None:
    model = _model(tiny["llama"])
    assert model.model.one_call_step is not None
    calls = []
    lib = one_call_step.load()
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
    assert plain.model.one_call_step is None
    assert one_call_step.one_call_step_for(plain.model) is None
    offset_norms = _model(make_tiny_model(tmp_path / "gemma3", "gemma3", num_layers=1))
    assert offset_norms.model.one_call_step is None  # Gemma's q/k norms by (1 + weight)


# --- with LoRA adapters ---------------------------------------------------------------


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
    lib = one_call_step.load()
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
    assert isinstance(model.model.one_call_step, one_call_step.OneCallStep)
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
    assert not one_call_step.can_use(model.model)
