"""The Triton fused MoE against its torch reference (under the interpreter on the CPU), the
grouping it runs on, and a token's result the same bits alone and in a batch (on a GPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from gpu_worker.kernels.fused_moe.kernel import BLOCK_M, align_by_expert, fused_moe  # noqa: E402
from gpu_worker.kernels.fused_moe.reference import fused_moe_reference  # noqa: E402
from gpu_worker.layers.moe_routing import Routing, combine, select_experts  # noqa: E402


def test_align_by_expert_pads_each_experts_run_to_the_block() -> None:
    ids = torch.tensor([[3, 1], [1, 0], [3, 2], [0, 1]])
    pair_ids, block_experts = align_by_expert(ids, 5, block_m=4)
    none = 8  # T * k
    assert block_experts.tolist() == [0, 1, 2, 3]
    assert pair_ids.tolist() == [3, 6, none, none, 1, 2, 7, none, 5, none, none, none,
                                 0, 4, none, none]  # fmt: skip


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "hidden", "width", "dtype"),
    [
        (5, 8, 2, 64, 32, torch.float32),  # Mixtral/OLMoE-like top-2
        (37, 16, 4, 96, 48, torch.float32),  # more rows than a block per expert
        (9, 8, 3, 64, 96, torch.bfloat16),
    ],
)
def test_fused_moe_matches_the_reference(
    device: torch.device, tokens: int, experts: int, top_k: int, hidden: int, width: int,
    dtype: torch.dtype,
) -> None:  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype).to(device)
    w13 = (0.2 * torch.randn(experts, 2 * width, hidden, generator=gen)).to(dtype).to(device)
    w2 = (0.2 * torch.randn(experts, hidden, width, generator=gen)).to(dtype).to(device)
    logits = torch.randn(tokens, experts, generator=gen).to(device)
    weights, ids = select_experts(logits, Routing(top_k, renormalize=True))
    pairs = fused_moe(x, w13, w2, weights, ids)
    got = combine(pairs, torch.ones_like(weights), ids, torch.float32)
    want = fused_moe_reference(x, w13, w2, weights, ids)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    # a token alone: the same bits as in the batch on a GPU (a row's MMA sums do not depend
    # on its place in the tile); the interpreter's numpy matmul does not promise that for a
    # row's place in the tile, so there only to rounding
    for t in (0, tokens - 1):
        alone = fused_moe(x[t : t + 1], w13, w2, weights[t : t + 1], ids[t : t + 1])
        if device.type == "cuda":
            assert torch.equal(alone[0], pairs[t])
        else:
            torch.testing.assert_close(alone[0], pairs[t], rtol=tol, atol=tol)
    assert BLOCK_M == 16


def test_the_triton_method_runs_a_layer_as_the_torch_reference(device: torch.device) -> None:
    from gpu_worker.layers.fused_moe import ExpertWeights, FusedMoE
    from gpu_worker.layers.moe_methods.triton import TritonMoEMethod

    gen = torch.Generator().manual_seed(5)
    w13 = [0.2 * torch.randn(64, 64, generator=gen) for _ in range(8)]
    w2 = [0.2 * torch.randn(64, 32, generator=gen) for _ in range(8)]
    reference = FusedMoE(8, 64, 32, Routing(2, renormalize=False))
    reference.method.load_weights(reference, ExpertWeights(w13, w2))
    layer = FusedMoE(8, 64, 32, Routing(2, renormalize=False))
    layer.method = TritonMoEMethod()
    layer.method.load_weights(layer, ExpertWeights([w.to(device) for w in w13],
                                                   [w.to(device) for w in w2]))  # fmt: skip
    x, logits = torch.randn(11, 64, generator=gen), torch.randn(11, 8, generator=gen)
    with torch.no_grad():
        got = layer(x.to(device), logits.to(device)).cpu()
        want = reference(x, logits)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert layer.tokens_per_expert == reference.tokens_per_expert


def test_int8_experts_by_the_triton_gemm_match_the_torch_path(device: torch.device) -> None:
    from gpu_worker.cpu.int8 import quantize_weight
    from gpu_worker.layers.fused_moe import ExpertWeights, FusedMoE
    from gpu_worker.layers.linear_methods.weights import Int8Weight
    from gpu_worker.layers.moe_methods.int8 import Int8MoEMethod

    gen = torch.Generator().manual_seed(6)
    w13 = [Int8Weight(*quantize_weight(0.2 * torch.randn(64, 64, generator=gen)))
           for _ in range(4)]  # fmt: skip
    w2 = [Int8Weight(*quantize_weight(0.2 * torch.randn(64, 32, generator=gen)))
          for _ in range(4)]  # fmt: skip
    layers = {}
    for kernel in ("torch", "triton"):
        layer = FusedMoE(4, 64, 32, Routing(2, renormalize=True))
        layer.method = Int8MoEMethod(kernel)
        on = device if kernel == "triton" else torch.device("cpu")
        moved = ExpertWeights(
            [Int8Weight(w.weight.to(on), w.scale.to(on)) for w in w13],
            [Int8Weight(w.weight.to(on), w.scale.to(on)) for w in w2],
        )
        layer.method.load_weights(layer, moved)
        layers[kernel] = layer
    x, logits = torch.randn(7, 64, generator=gen), torch.randn(7, 4, generator=gen)
    with torch.no_grad():
        want = layers["torch"](x, logits)
        got = layers["triton"](x.to(device), logits.to(device)).cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
