"""The CPU LoRA kernel (gpu_worker/cpu/lora.c) against the contract's reference
(gpu_worker/lora/layer.py's lora_delta_reference): mixed slots with base tokens, ragged
segments, ranks below the buffer's, several slices, bfloat16, any number of threads."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.cpu import lora
from gpu_worker.lora.layer import lora_delta_reference

pytestmark = pytest.mark.skipif(lora.load() is None, reason="no C compiler here")


def _adapters(
    num_loras: int, bounds: list[int], rank: int, in_features: int, used_rank: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random slots whose adapters use only `used_rank` of `rank` (the rest zeros, as a
    lower-rank adapter is loaded), slot 1 left empty."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(num_loras, len(bounds) - 1, rank, in_features, generator=gen)
    b = torch.randn(num_loras, bounds[-1], rank, generator=gen) * 0.1
    a[:, :, used_rank:] = 0
    b[:, :, used_rank:] = 0
    if num_loras > 1:
        a[1], b[1] = 0, 0
    return a, b


def _slots(pattern: str, tokens: int, num_loras: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if pattern == "round-robin":  # a decode step: every token its own adapter, base among them
        slots = [(t % (num_loras + 1)) - 1 for t in range(tokens)]
    elif pattern == "ragged":  # prefill chunks of several requests: runs of random lengths
        slots = []
        while len(slots) < tokens:
            run = int(torch.randint(1, 40, (1,), generator=gen))
            slots += [int(torch.randint(-1, num_loras, (1,), generator=gen))] * run
        slots = slots[:tokens]
    else:
        slots = torch.randint(-1, num_loras, (tokens,), generator=gen).tolist()
    return torch.tensor(slots, dtype=torch.int32)


@pytest.mark.parametrize("tokens", [1, 3, 8, 37, 130])
@pytest.mark.parametrize("pattern", ["round-robin", "ragged", "random"])
@pytest.mark.parametrize(
    ("bounds", "in_features"),
    [([0, 96], 40), ([0, 64, 80, 96], 64), ([0, 70, 140], 48), ([0, 33], 160)],
)
def test_equals_the_reference(
    tokens: int, pattern: str, bounds: list[int], in_features: int
) -> None:
    num_loras, rank = 4, 16
    a, b = _adapters(num_loras, bounds, rank, in_features, used_rank=rank, seed=tokens)
    x = torch.randn(tokens, in_features)
    slots = _slots(pattern, tokens, num_loras, seed=tokens)
    y0 = torch.randn(tokens, bounds[-1])
    y = y0.clone()
    assert lora.lora_add(y, x, a, b, lora.slice_bounds_tensor(bounds), slots)
    expected = y0 + lora_delta_reference(x, a, b, bounds, slots)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(y[slots < 0], y0[slots < 0])  # base tokens untouched


@pytest.mark.parametrize(("rank", "used_rank"), [(16, 4), (8, 8), (5, 3), (32, 17), (1, 1)])
def test_ranks(rank: int, used_rank: int) -> None:
    bounds = [0, 48, 64, 80]
    a, b = _adapters(3, bounds, rank, 56, used_rank, seed=rank)
    x, slots = torch.randn(20, 56), _slots("random", 20, 3, seed=rank)
    y = torch.zeros(20, 80)
    assert lora.lora_add(y, x, a, b, lora.slice_bounds_tensor(bounds), slots)
    torch.testing.assert_close(y, lora_delta_reference(x, a, b, bounds, slots))


def test_bfloat16_weights_and_output() -> None:
    """bf16 adapters and a bf16 y: float32 sums, y rounded once after the add."""
    bounds = [0, 64, 96]
    a, b = _adapters(4, bounds, 16, 64, 16, seed=7)
    a16, b16 = a.bfloat16(), b.bfloat16()
    x = torch.randn(24, 64).bfloat16()
    slots = _slots("ragged", 24, 4, seed=7)
    y0 = torch.randn(24, 96).bfloat16()
    y = y0.clone()
    assert lora.lora_add(y, x, a16, b16, lora.slice_bounds_tensor(bounds), slots)
    exact = y0.float() + lora_delta_reference(x, a16, b16, bounds, slots)
    assert y.dtype == torch.bfloat16
    # one rounding of the float32 sum: within half a bf16 step (its float32 sums' order
    # differs from torch's in the last bits)
    assert ((y.float() - exact).abs() <= exact.abs() * 2**-8 + 1e-5).all()
    y32 = y0.float()
    assert lora.lora_add(y32, x, a16, b16, lora.slice_bounds_tensor(bounds), slots)
    torch.testing.assert_close(y32, exact, rtol=1e-5, atol=1e-5)


def test_same_bits_with_any_number_of_threads() -> None:
    bounds = [0, 576, 768, 960]
    a, b = _adapters(8, bounds, 16, 576, 16, seed=3)
    x, slots = torch.randn(70, 576), _slots("ragged", 70, 8, seed=3)
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            y = torch.zeros(70, 960)
            assert lora.lora_add(y, x, a, b, lora.slice_bounds_tensor(bounds), slots)
            results.append(y)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(results[0], r) for r in results[1:])


def test_refuses_inputs_outside_the_contract() -> None:
    a, b = _adapters(2, [0, 8], 4, 8, 4, seed=0)
    bounds, y, x = lora.slice_bounds_tensor([0, 8]), torch.zeros(2, 8), torch.randn(2, 8)
    with pytest.raises(ValueError, match="slot"):
        lora.lora_add(y, x, a, b, bounds, torch.tensor([0, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="slot"):
        lora.lora_add(y, x, a, b, bounds, torch.tensor([0, -2], dtype=torch.int32))
    with pytest.raises(ValueError, match="lora_add"):
        lora.lora_add(y, torch.randn(2, 9), a, b, bounds, torch.tensor([0, 1], dtype=torch.int32))
    assert torch.equal(y, torch.zeros(2, 8))
    empty = torch.zeros(0, 8)
    assert lora.lora_add(empty, torch.zeros(0, 8), a, b, bounds, torch.zeros(0, dtype=torch.int32))


def test_a_token_gets_the_same_bits_in_any_batch() -> None:
    """Tokens are grouped by slot and each one's sums run in a fixed order: a token's delta
    does not depend on the rest of its batch (a request's output does not either)."""
    bounds = [0, 64, 80, 96]
    a, b = _adapters(4, bounds, 16, 72, 16, seed=11)
    x, slots = torch.randn(33, 72), _slots("random", 33, 4, seed=11)
    bt = lora.slice_bounds_tensor(bounds)
    batch = torch.zeros(33, 96)
    assert lora.lora_add(batch, x, a, b, bt, slots)
    for t in (0, 5, 32):
        alone = torch.zeros(1, 96)
        assert lora.lora_add(alone, x[t : t + 1], a, b, bt, slots[t : t + 1])
        assert torch.equal(alone[0], batch[t])
