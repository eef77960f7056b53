"""The one-call step (gpu_worker/cpu/one_call_step.py, one_call_step.c) on mixtures of experts
against the layer-by-layer path: every family (Qwen3-MoE's per-head and OLMoE's whole q/k
norms, Qwen2-MoE's gated shared expert and dense layers, Mixtral, gpt-oss's router bias,
clamped SwiGLU with expert biases, sinks and alternating windows) and every expert weight the
C MoE path keeps (float32, MXFP4, GGUF, int8): the same hidden states bit for bit, the same
K/V written, the same tokens counted per expert, and a token's result the same bits alone
and in a batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gpu_worker.attention.metadata import AttentionMetadata, build_metadata
from gpu_worker.cpu import moe as cpu_moe
from gpu_worker.cpu import one_call_step
from gpu_worker.layers.fused_moe import FusedMoE, take_tokens_per_expert
from gpu_worker.models.llama import LlamaForCausalLM
from tests.gguf_moe_models import write_moe_gguf
from tests.tiny_moe_models import MOE_ARCHS, make_tiny_moe_model, make_tiny_mxfp4_gpt_oss
from tests.unit.gpu_worker.cpu.test_one_call_step import (
    BLOCK_SIZE,
    _layer_by_layer,
    _model,
    _one_call,
    _step,
)

pytestmark = pytest.mark.skipif(
    one_call_step.load() is None or cpu_moe.load() is None, reason="no C compiler here"
)

ARCHS = (*MOE_ARCHS, "gpt_oss")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("one-call-moe")


def _folder(root: Path, arch: str) -> Path:
    return make_tiny_moe_model(root / arch, arch)


def _equal_to_the_layers(model: LlamaForCausalLM, n: int, seed: int) -> None:
    """A decode step of n sequences by the one-call step and by the layers: the same hidden
    states, K/V and tokens per expert."""
    assert isinstance(model.model.one_call_step, one_call_step.OneCallStep)
    ids, kv, meta = _step(model, n, seed=seed)
    kv_layers = kv.clone()
    take_tokens_per_expert(model)
    with torch.inference_mode():
        expected = _layer_by_layer(model, ids, meta.positions, kv_layers, meta)
    counted = take_tokens_per_expert(model)
    got = _one_call(model, ids, meta.positions, kv, meta)
    assert torch.equal(got, expected)
    assert torch.equal(kv, kv_layers)
    assert take_tokens_per_expert(model) == counted and sum(counted) > 0


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("n", [1, 5, 8])
def test_moe_one_call_equals_the_layers_bit_for_bit(root: Path, arch: str, n: int) -> None:
    _equal_to_the_layers(_model(_folder(root, arch)), n, seed=n)


def _alone(model: LlamaForCausalLM, meta: AttentionMetadata, i: int) -> AttentionMetadata:
    """Sequence i of a decode step's metadata as a step of its own."""
    length = int(meta.seq_lens[i])
    table = meta.block_tables[i, : (length + BLOCK_SIZE - 1) // BLOCK_SIZE].tolist()
    backend = model.model.layers[0].self_attn.backend
    return backend.build_metadata(build_metadata([length - 1], [1], [table], BLOCK_SIZE))


@pytest.mark.parametrize("arch", ["qwen2_moe", "gpt_oss"])
def test_a_token_is_the_same_bits_alone_and_in_a_batch(root: Path, arch: str) -> None:
    model = _model(_folder(root, arch))
    ids, kv, meta = _step(model, 6, seed=3)
    batch = _one_call(model, ids, meta.positions, kv.clone(), meta)
    for i in range(6):
        alone = _alone(model, meta, i)
        got = _one_call(model, ids[i : i + 1], alone.positions, kv.clone(), alone)
        assert torch.equal(got[0], batch[i])


def _mxfp4(root: Path) -> LlamaForCausalLM:
    packed, _ = make_tiny_mxfp4_gpt_oss(root / "mxfp4")
    return _model(packed)


def _gguf(root: Path) -> LlamaForCausalLM:
    path = root / "qwen2_moe-Q8_0.gguf"
    if not path.is_file():
        # llama.cpp's qwen2moe has experts in every layer
        folder = make_tiny_moe_model(root / "qwen2_moe-sparse", "qwen2_moe", decoder_sparse_step=1)
        write_moe_gguf(folder, path, Q.Q8_0)
    return _model(path)


def _int8(root: Path) -> LlamaForCausalLM:
    from gpu_worker.attention.torch_backend import TorchAttentionBackend
    from gpu_worker.layers.kernel_choice import choose_kernels
    from gpu_worker.model_loader.hf_folder import read_hf_config
    from gpu_worker.model_loader.loader import load_model
    from gpu_worker.models.llama_config import LlamaConfig

    folder, cpu = _folder(root, "mixtral"), torch.device("cpu")
    cfg = LlamaConfig.from_hf(read_hf_config(folder))
    backend = TorchAttentionBackend(
        num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        dtype=torch.float32, device=cpu,
    )  # fmt: skip
    kernels = choose_kernels(device=cpu, backend_name="torch", dtype=torch.float32)
    return load_model(
        folder, backend, dtype=torch.float32, device=cpu, max_positions=256, kernels=kernels,
        quantization="int8",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("storage", "build"), [("mxfp4", _mxfp4), ("gguf:Q8_0", _gguf), ("int8", _int8)]
)
def test_quantized_experts_equal_the_layers_bit_for_bit(
    root: Path, storage: str, build: object
) -> None:
    assert callable(build)
    model = build(root)
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert experts and all(e.method.storage == storage for e in experts)
    for n in (1, 7):
        _equal_to_the_layers(model, n, seed=20 + n)


def test_experts_moe_c_does_not_run_take_the_layers(root: Path) -> None:
    """Experts on torch's arithmetic (the float reference method): the step is not taken,
    the layers run (as for any part without a descriptor)."""
    from gpu_worker.layers.fused_moe import FloatMoEMethod

    model = _model(_folder(root, "mixtral"))
    for m in model.modules():
        if isinstance(m, FusedMoE):
            m.method = FloatMoEMethod()
    assert not one_call_step.can_use(model.model)


@pytest.mark.parametrize("arch", ["qwen2_moe", "gpt_oss"])
def test_bfloat16_moe_within_bf16_precision(root: Path, arch: str) -> None:
    """A bf16 model's step keeps float32 activations (the layers round each op to bf16, and
    route bf16 logits by torch): within bf16's precision of the layers."""
    model = _model(_folder(root, arch), dtype=torch.bfloat16)
    ids, kv, meta = _step(model, 4, seed=9)
    with torch.inference_mode():
        layers = _layer_by_layer(model, ids, meta.positions, kv.clone(), meta).float()
    got = _one_call(model, ids, meta.positions, kv, meta)
    assert got.dtype == torch.bfloat16
    assert (got.float() - layers).abs().max() <= 0.05 * layers.abs().max()  # measured 0.008-0.01
