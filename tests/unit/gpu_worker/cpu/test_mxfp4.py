"""MXFP4 (gpt-oss's shipped experts): the torch dequantization against transformers' own, the
C kernel (gpu_worker/cpu/mxfp4.c) against the dequantized reference and bitwise the same for a
row alone and in any batch, and the packed MoE method against float experts on the
dequantized weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.cpu import mxfp4 as cpu_mxfp4
from gpu_worker.layers.fused_moe import ExpertWeights, FloatMoEMethod, FusedMoE
from gpu_worker.layers.linear_methods.weights import MXFP4Weight
from gpu_worker.layers.moe_methods.mxfp4 import MXFP4MoEMethod, dequantize_mxfp4
from gpu_worker.layers.moe_routing import Routing

torch.set_num_threads(2)

needs_kernel = pytest.mark.skipif(cpu_mxfp4.load() is None, reason="no C compiler")


def _packed(
    out: int, n_in: int, experts: int = 0, seed: int = 0, exponents: tuple[int, int] = (118, 130)
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lead = (experts,) if experts else ()
    blocks = torch.randint(0, 256, (*lead, out, n_in // 32, 16), generator=gen)
    scales = torch.randint(*exponents, (*lead, out, n_in // 32), generator=gen)
    return blocks.to(torch.uint8), scales.to(torch.uint8)


def test_dequantize_is_transformers_layout() -> None:
    """transformers' convert_moe_packed_tensors gives [E, in, out] (x @ W); ours [E, out, in]."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _packed(24, 96, experts=3)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    got = dequantize_mxfp4(blocks, scales)
    assert torch.equal(got.transpose(1, 2), want)
    # byte 0x21: 0.5 (low nibble 1: value 0) then 1.0 (high nibble 2: value 1), times 2 ** 1
    one = dequantize_mxfp4(torch.tensor([[[0x21] + [0] * 15]], dtype=torch.uint8),
                           torch.tensor([[128]], dtype=torch.uint8))  # fmt: skip
    assert one[0, :3].tolist() == [1.0, 2.0, 0.0]


@needs_kernel
def test_c_dequantize_equals_the_torch_reference() -> None:
    blocks, scales = _packed(40, 160)
    assert torch.equal(cpu_mxfp4.dequantize(blocks, scales), dequantize_mxfp4(blocks, scales))


@needs_kernel
@pytest.mark.parametrize("shape", [(24, 64), (160, 96), (7, 2880 // 10)])
def test_c_rows_match_the_dequantized_linear_and_are_batch_invariant(
    shape: tuple[int, int],
) -> None:
    out, n_in = shape[0], shape[1] - shape[1] % 32
    blocks, scales = _packed(out, n_in, seed=out)
    bias = torch.randn(out)
    x = torch.randn(21, n_in)
    want = F.linear(x, dequantize_mxfp4(blocks, scales), bias)
    got = cpu_mxfp4.linear_rows(x, blocks, scales, bias)
    assert got is not None  # sums of ~100 terms up to 24 in size: float32 rounding of ~1e-5
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    for n in (1, 2, 7, 8, 9, 16):  # a row's bits never depend on its call's other rows
        for lo in (0, 21 - n):
            part = cpu_mxfp4.linear_rows(x[lo : lo + n], blocks, scales, bias)
            assert part is not None and torch.equal(part, got[lo : lo + n])
    bf = cpu_mxfp4.linear_rows(x.bfloat16(), blocks, scales, None)
    assert bf is not None and bf.dtype == torch.bfloat16


def test_bad_blocks_are_refused_by_shape() -> None:
    blocks, scales = _packed(8, 64)
    with pytest.raises(ValueError, match=r"uint8 \[out, in/32, 16\]"):
        cpu_mxfp4.linear_rows(torch.randn(2, 64), blocks, scales[:, :1].contiguous(), None)


@pytest.mark.parametrize("kernel", ["cpu", "torch"])
def test_packed_experts_equal_float_experts_on_the_dequantized_weights(kernel: str) -> None:
    if kernel == "cpu" and cpu_mxfp4.load() is None:
        pytest.skip("no C compiler")
    experts, hidden, width = 6, 64, 32
    # weights of a trained model's size (2 ** -7 .. 2 ** -3 times E2M1's values)
    w13 = _packed(2 * width, hidden, experts, seed=1, exponents=(120, 125))
    w2 = _packed(hidden, width, experts, seed=2, exponents=(120, 125))
    b13, b2 = 0.1 * torch.randn(experts, 2 * width), 0.1 * torch.randn(experts, hidden)

    def layer() -> FusedMoE:
        return FusedMoE(
            experts, hidden, width, Routing(3, renormalize=False, scoring="topk_softmax"),
            activation="swiglu_clamp", bias=True,
        )  # fmt: skip

    packed = layer()
    packed.method = MXFP4MoEMethod(kernel)
    packed.method.load_weights(
        packed,
        ExpertWeights(
            [MXFP4Weight(b, s) for b, s in zip(*w13, strict=True)],
            [MXFP4Weight(b, s) for b, s in zip(*w2, strict=True)],
            b13, b2,
        ),
    )  # fmt: skip
    packed.method.process_weights_after_loading(packed)
    assert packed.w13_weight.dtype == torch.uint8  # resident packed: 17 bytes per 32 values
    reference = layer()
    reference.method = FloatMoEMethod()
    reference.method.load_weights(
        reference,
        ExpertWeights(
            list(dequantize_mxfp4(*w13)), list(dequantize_mxfp4(*w2)), b13, b2
        ),
    )  # fmt: skip
    x, logits = torch.randn(19, hidden), torch.randn(19, experts)
    want = reference(x, logits)
    got = packed(x, logits)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if kernel == "cpu":  # a token alone: the same bits as in the batch
        for t in (0, 7, 18):
            assert torch.equal(packed(x[t : t + 1], logits[t : t + 1]), got[t : t + 1])
