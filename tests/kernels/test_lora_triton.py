"""The Triton LoRA kernels (gpu_worker/kernels/lora/) against the torch reference, under the
interpreter on the CPU (compiled and run on CUDA where there is one): mixed slots with base
tokens, one to three slices, ranks below the buffer's and not powers of two, bf16."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from gpu_worker.kernels.lora.kernel import (  # noqa: E402
    MAX_BGMV_TOKENS,
    lora_add,
    lora_tiles,
    slot_groups,
)
from gpu_worker.kernels.lora.reference import lora_add_reference  # noqa: E402


def _case(
    tokens: int, bounds: list[int], in_features: int, rank: int, num_loras: int, seed: int,
    dtype: torch.dtype, device: torch.device,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(num_loras, len(bounds) - 1, rank, in_features, generator=gen)
    b = torch.randn(num_loras, bounds[-1], rank, generator=gen) * 0.1
    a[:, :, rank - rank // 3 :] = 0  # a lower-rank adapter in a wider buffer
    x = torch.randn(tokens, in_features, generator=gen)
    y = torch.randn(tokens, bounds[-1], generator=gen)
    slots = torch.randint(-1, num_loras, (tokens,), generator=gen, dtype=torch.int32)
    slots[: tokens // 2] = slots[0]  # a run of one adapter, as a prefill chunk's
    return tuple(t.to(device) for t in (y.to(dtype), x.to(dtype), a.to(dtype), b.to(dtype), slots))


@pytest.mark.parametrize(
    ("tokens", "bounds", "in_features", "rank"),
    [
        (1, [0, 48], 40, 16),
        (5, [0, 64, 80, 96], 64, 8),
        (9, [0, 70, 140], 48, 5),
        (3, [0, 300], 130, 32),
        (4, [0, 24, 40, 56], 300, 64),
        # more than MAX_BGMV_TOKENS: the segment (sgmv) kernels
        (MAX_BGMV_TOKENS + 1, [0, 48], 40, 16),
        (45, [0, 64, 80, 96], 64, 8),
        (70, [0, 70, 140], 100, 5),
        (33, [0, 24, 40, 56], 130, 64),
    ],
)
def test_equals_the_reference(
    device: torch.device, tokens: int, bounds: list[int], in_features: int, rank: int
) -> None:
    y, x, a, b, slots = _case(tokens, bounds, in_features, rank, 3, tokens, torch.float32, device)
    expected = lora_add_reference(y.cpu(), x.cpu(), a.cpu(), b.cpu(), bounds, slots.cpu())
    lora_add(y, x, a, b, bounds, slots)
    torch.testing.assert_close(y.cpu(), expected, rtol=1e-5, atol=1e-5)
    base = slots.cpu() < 0
    y0 = _case(tokens, bounds, in_features, rank, 3, tokens, torch.float32, device)[0]
    assert torch.equal(y.cpu()[base], y0.cpu()[base])  # base rows untouched


def test_bfloat16(device: torch.device) -> None:
    bounds = [0, 64, 96]
    y, x, a, b, slots = _case(6, bounds, 64, 16, 4, 1, torch.bfloat16, device)
    expected = lora_add_reference(y.cpu(), x.cpu(), a.cpu(), b.cpu(), bounds, slots.cpu())
    lora_add(y, x, a, b, bounds, slots)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.cpu().float(), expected.float(), rtol=1e-2, atol=1e-2)


def test_all_base_and_empty(device: torch.device) -> None:
    bounds = [0, 32]
    y, x, a, b, _ = _case(3, bounds, 16, 4, 2, 0, torch.float32, device)
    before = y.clone()
    lora_add(y, x, a, b, bounds, torch.full((3,), -1, dtype=torch.int32, device=device))
    assert torch.equal(y, before)
    lora_add(y[:0], x[:0], a, b, bounds, torch.zeros(0, dtype=torch.int32, device=device))


def test_bfloat16_segments(device: torch.device) -> None:
    bounds = [0, 64, 96]
    y, x, a, b, slots = _case(40, bounds, 64, 16, 4, 2, torch.bfloat16, device)
    expected = lora_add_reference(y.cpu(), x.cpu(), a.cpu(), b.cpu(), bounds, slots.cpu())
    lora_add(y, x, a, b, bounds, slots)
    torch.testing.assert_close(y.cpu().float(), expected.float(), rtol=1e-2, atol=1e-2)


def test_slot_groups() -> None:
    slots = torch.tensor([2, -1, 0, 2, -1, 2, 0], dtype=torch.int32)
    order, starts, counts = slot_groups(slots, num_loras=4)
    assert order.tolist() == [1, 4, 2, 6, 0, 3, 5]  # base, slot 0, slot 2; stable
    assert counts.tolist() == [2, 2, 0, 3, 0] and starts.tolist() == [0, 2, 4, 4, 7]


def test_tiles() -> None:
    assert lora_tiles(16) == (16, 256, 256)
    assert lora_tiles(64) == (64, 64, 64)
    assert lora_tiles(5)[0] == 16 and lora_tiles(33)[0] == 64


def test_layers_with_the_triton_kernel_equal_the_reference(tiny_llama: Path) -> None:
    """LoraLinearMethod's "triton" kernel in a model's forward (a prefill of two adapters
    and the base model) against its "torch" reference."""
    from gpu_worker.attention.metadata import build_metadata
    from gpu_worker.lora.layer import enable_lora, lora_layers
    from tests.unit.gpu_worker.cpu.test_one_call_step import _model

    if torch.cuda.is_available():
        pytest.skip("a CPU model: the interpreter's path")
    outputs = []
    for kernel in ("triton", "torch"):
        model = _model(tiny_llama, cpu_layers=False)
        mapping = enable_lora(model, max_loras=3, max_rank=8, max_tokens=16, kernel=kernel)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for _, layer, _ in lora_layers(model):
                for t in (layer.method.lora_a, layer.method.lora_b):  # type: ignore[attr-defined]
                    t.copy_(torch.randn(t.shape, generator=gen) * 0.3)
        inner = model.model
        attn = inner.layers[0].self_attn
        kv = torch.zeros(len(inner.layers), 2, 8, 4, attn.num_kv_heads, attn.head_dim)
        meta = attn.backend.build_metadata(build_metadata([0, 0], [5, 6], [[0, 1], [2, 3]], 4))
        mapping.set([0] * 3 + [-1] * 2 + [2] * 6)
        with torch.inference_mode():
            outputs.append(inner(torch.arange(11), meta.positions, kv, meta))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-4, atol=1e-4)  # 2 layers' sums


def test_reference_equals_the_contracts() -> None:
    """reference.py (per token) against gpu_worker/lora/layer.py's lora_delta_reference (per
    slot): one formula, spelled twice."""
    from gpu_worker.lora.layer import lora_delta_reference

    bounds = [0, 64, 80, 96]
    y, x, a, b, slots = _case(30, bounds, 48, 8, 3, 4, torch.float32, torch.device("cpu"))
    expected = y + lora_delta_reference(x, a, b, bounds, slots)
    torch.testing.assert_close(lora_add_reference(y, x, a, b, bounds, slots), expected)
