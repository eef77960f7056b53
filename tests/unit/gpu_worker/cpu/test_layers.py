"""The C layer kernels (gpu_worker/cpu/layers.py) against the torch modules they replace."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from gpu_worker.cpu import layers
from gpu_worker.kernels.rotary.reference import rotate_reference
from gpu_worker.layers.ops_cpu import CpuLayerOps, cpu_layer_ops
from gpu_worker.models.llama import MLP, RMSNorm, RotaryEmbedding
from gpu_worker.models.llama_config import LlamaConfig

pytestmark = pytest.mark.skipif(layers.load() is None, reason="no C compiler here")

CLOSE = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_rms_norm_and_the_fused_residual_add(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.randn(576, generator=gen)
    x, res = torch.randn(rows, 576, generator=gen), torch.randn(rows, 576, generator=gen)
    torch.testing.assert_close(layers.rms_norm(x, norm.weight, norm.eps), norm(x), **CLOSE)
    out, total = layers.add_rms_norm(x, res, norm.weight, norm.eps)
    torch.testing.assert_close(total, x + res, rtol=0, atol=0)
    torch.testing.assert_close(out, norm(x + res), **CLOSE)


@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_rotary_in_place_on_a_strided_view(tokens: int) -> None:
    rope = RotaryEmbedding(64, 512, 10000.0, None, torch.device("cpu"))
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, 9 * 64 + 2 * 3 * 64, generator=gen)
    q = qkv[:, : 9 * 64].view(tokens, 9, 64)  # a view of the fused projection, as in the model
    positions = torch.randint(0, 512, (tokens,), generator=gen)
    expected = rope.rotate(q.clone(), *rope(positions, torch.float32))
    cos, sin = rope.tables()
    layers.rotary_neox(q, positions, cos, sin)
    torch.testing.assert_close(q, expected, **CLOSE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_rotary_rotates_the_first_dims_and_passes_the_rest(dtype: torch.dtype) -> None:
    """Phi-4-mini's shape: tables 12 wide rotate the first 24 of each 32-dim head."""
    rope = RotaryEmbedding(24, 512, 10000.0, None, torch.device("cpu"))
    gen = torch.Generator().manual_seed(3)
    tokens = 20  # over PAR_ROWS: both threads
    qkv = torch.randn(tokens, 5 * 32 + 2 * 32, generator=gen).to(dtype)
    q = qkv[:, : 5 * 32].view(tokens, 5, 32)
    before = q.clone()
    positions = torch.randint(0, 512, (tokens,), generator=gen)
    expected = rope.rotate(q.clone(), *rope(positions, dtype))
    reference = rotate_reference(q, positions, *rope.tables())
    layers.rotary_neox(q, positions, *rope.tables())
    assert torch.equal(q[..., 24:], before[..., 24:])
    if dtype == torch.bfloat16:
        assert torch.equal(q, expected)  # the torch path's roundings, bit for bit
    torch.testing.assert_close(q, expected, **CLOSE)
    close = CLOSE if dtype == torch.float32 else dict(rtol=2**-6, atol=2**-6)
    torch.testing.assert_close(q.float(), reference, **close)


def test_silu_mul_is_the_swiglu_activation() -> None:
    gate_up = torch.randn(7, 2 * 1536) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(layers.silu_mul(gate_up), expected, **CLOSE)


def _cfg() -> LlamaConfig:
    return LlamaConfig(
        model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=96,
        num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
        rope_theta=10000.0, rope_scaling=None, max_position_embeddings=64,
        tie_word_embeddings=False, qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False,
    )  # fmt: skip


def _with_ops(module: nn.Module, ops: CpuLayerOps) -> nn.Module:
    """A copy of `module` whose norms and MLPs call `ops` (as the loader builds them)."""
    copied = copy.deepcopy(module)
    for m in copied.modules():
        if isinstance(m, RMSNorm | MLP):
            m.ops = ops
    return copied


def test_the_cpu_ops_serve_float32_and_bfloat16_models_only() -> None:
    mlp = MLP(_cfg())
    x = torch.randn(3, 64)
    ops = cpu_layer_ops(torch.float32)
    assert ops is not None and cpu_layer_ops(torch.bfloat16) is not None
    wrapper = nn.Sequential(mlp, RMSNorm(64, 1e-5))
    torch.testing.assert_close(_with_ops(wrapper, ops)(x), wrapper(x), **CLOSE)
    assert cpu_layer_ops(torch.float16) is None


BF16_ULP = dict(rtol=2**-7, atol=1e-6)  # one bf16 rounding


def test_bfloat16_kernels_round_where_the_torch_modules_round() -> None:
    gen = torch.Generator().manual_seed(7)
    rows, dim = 20, 576  # over PAR_ROWS: both threads
    norm = RMSNorm(dim, 1e-5)
    norm.weight.data = torch.randn(dim, generator=gen)
    norm = norm.to(torch.bfloat16)
    x = torch.randn(rows, dim, generator=gen).to(torch.bfloat16)
    res = torch.randn(rows, dim, generator=gen).to(torch.bfloat16)
    assert torch.equal(layers.rms_norm(x, norm.weight, norm.eps), norm(x))
    out, total = layers.add_rms_norm(x, res, norm.weight, norm.eps)
    assert torch.equal(total, x + res) and torch.equal(out, norm(x + res))

    rope = RotaryEmbedding(64, 512, 10000.0, None, torch.device("cpu"))
    qkv = torch.randn(rows, 9 * 64 + 2 * 3 * 64, generator=gen).to(torch.bfloat16)
    q = qkv[:, : 9 * 64].view(rows, 9, 64)
    positions = torch.randint(0, 512, (rows,), generator=gen)
    expected = rope.rotate(q.clone(), *rope(positions, torch.bfloat16))
    layers.rotary_neox(q, positions, *rope.tables())
    assert torch.equal(q, expected)

    gate_up = (torch.randn(rows, 2 * 1536, generator=gen) * 4).to(torch.bfloat16)
    gate, up = gate_up.chunk(2, dim=-1)
    silu = layers.silu_mul(gate_up)
    assert silu.dtype == torch.bfloat16
    torch.testing.assert_close(silu, torch.nn.functional.silu(gate) * up, **BF16_ULP)


def test_bfloat16_models_take_the_ops_too() -> None:
    mlp = MLP(_cfg()).to(torch.bfloat16)
    x = torch.randn(3, 64).to(torch.bfloat16)
    expected = mlp(x)
    ops = cpu_layer_ops(torch.bfloat16)
    assert ops is not None
    torch.testing.assert_close(_with_ops(mlp, ops)(x), expected, **BF16_ULP)
