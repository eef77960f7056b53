"""The MXFP4 GEMM (gpt-oss's packed experts, CUDA) against the torch dequantization: in
float32 the two differ only by the order of a sum's roundings; bf16 by the output's rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from gpu_worker.kernels import interpreting  # noqa: E402
from gpu_worker.kernels.mxfp4_matmul.kernel import mxfp4_matmul  # noqa: E402
from gpu_worker.layers.moe_methods.mxfp4 import dequantize_mxfp4  # noqa: E402


def _packed(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n, k // 32, 16), generator=gen).to(torch.uint8)
    scales = torch.randint(120, 130, (n, k // 32), generator=gen).to(torch.uint8)
    return blocks, scales


@pytest.mark.parametrize("m", [1, 5, 17, 70])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_dequantized_linear_fp32(m: int, bias: bool, device) -> None:
    n, k = 72, 160  # a partial BLOCK_N tile; 5 groups
    blocks, scales = _packed(n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(100 + m))
    b = torch.randn(n) if bias else None
    want = F.linear(x.double(), dequantize_mxfp4(blocks, scales).double(),
                    None if b is None else b.double())  # fmt: skip
    got = mxfp4_matmul(
        x.to(device), blocks.to(device), scales.to(device), None if b is None else b.to(device)
    )
    torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=1e-4)


# Triton 3.x's interpreter computes tl.dot on bf16 tiles wrongly (as tests/kernels/
# test_gguf_matmul.py notes): bf16 runs on a GPU only
BF16 = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    interpreting(), reason="the Triton interpreter's bf16 tl.dot is wrong"))  # fmt: skip


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_half_precision(dtype: torch.dtype, device) -> None:
    n, k = 64, 128
    blocks, scales = _packed(n, k, seed=3)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(4)).to(dtype)
    want = F.linear(x.float(), dequantize_mxfp4(blocks, scales))
    got = mxfp4_matmul(x.to(device), blocks.to(device), scales.to(device))
    assert got.dtype == dtype
    torch.testing.assert_close(got.cpu().float(), want, rtol=2.0**-7, atol=2e-2)


def test_a_bad_shape_is_refused(device) -> None:
    blocks, scales = _packed(8, 64, seed=5)
    with pytest.raises(AssertionError, match="scales must be uint8"):
        mxfp4_matmul(torch.randn(2, 64, device=device), blocks.to(device),
                     scales[:, :1].contiguous().to(device))  # fmt: skip


@pytest.mark.parametrize("tokens", [1, 13])
def test_the_triton_mxfp4_method_runs_a_layer_as_the_torch_reference(tokens: int, device) -> None:
    """gpt-oss's layer (top-4 of 8, router softmax over the top logits, clamped SwiGLU on
    alternate gate/up rows, experts' biases) with packed experts: Triton = torch reference."""
    from gpu_worker.layers.fused_moe import ExpertWeights, FusedMoE
    from gpu_worker.layers.linear_methods.weights import MXFP4Weight
    from gpu_worker.layers.moe_methods.mxfp4 import MXFP4MoEMethod
    from gpu_worker.layers.moe_routing import Routing

    experts, hidden, width = 8, 64, 32
    w13 = [_packed(2 * width, hidden, seed=10 + e) for e in range(experts)]
    w2 = [_packed(hidden, width, seed=30 + e) for e in range(experts)]
    gen = torch.Generator().manual_seed(7)
    b13 = 0.1 * torch.randn(experts, 2 * width, generator=gen)
    b2 = 0.1 * torch.randn(experts, hidden, generator=gen)
    layers = {}
    for kernel in ("torch", "triton"):
        on = device if kernel == "triton" else torch.device("cpu")
        layer = FusedMoE(
            experts, hidden, width, Routing(4, renormalize=False, scoring="topk_softmax"),
            activation="swiglu_clamp", bias=True,
        )  # fmt: skip
        layer.method = MXFP4MoEMethod(kernel)
        layer.method.load_weights(
            layer,
            ExpertWeights(
                [MXFP4Weight(b.to(on), s.to(on)) for b, s in w13],
                [MXFP4Weight(b.to(on), s.to(on)) for b, s in w2],
                b13.to(on), b2.to(on),
            ),
        )  # fmt: skip
        layer.method.process_weights_after_loading(layer)
        assert layer.method.kernel == kernel
        layers[kernel] = layer
    x = 0.05 * torch.randn(tokens, hidden, generator=gen)
    logits = torch.randn(tokens, experts, generator=gen)
    with torch.no_grad():
        want = layers["torch"](x, logits)
        got = layers["triton"](x.to(device), logits.to(device)).cpu()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
