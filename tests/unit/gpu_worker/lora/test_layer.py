"""gpu_worker/lora/layer.py: the step's mapping (long runs of one adapter cut out for the
GEMM) and LoraLinearMethod's CPU path (GEMM for long runs, the C kernel for the rest) against
the reference formula."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.layers.linear import FloatLinearMethod, Linear
from gpu_worker.lora.layer import (
    LONG_RUN,
    LoraLinearMethod,
    LoraMapping,
    lora_delta_reference,
)


def test_long_runs_of_one_adapter_are_cut_out_of_the_short_slots() -> None:
    mapping = LoraMapping(8, torch.device("cpu"))
    slots = [0] * LONG_RUN + [1, 1, -1] + [-1] * LONG_RUN + [2] * (LONG_RUN + 3) + [0]
    mapping.set(slots)
    first = LONG_RUN + 3 + LONG_RUN
    assert mapping.long_runs == [(0, 0, LONG_RUN), (2, first, first + LONG_RUN + 3)]
    short = mapping.short_slots.tolist()
    assert short == [-1] * LONG_RUN + [1, 1, -1] + [-1] * (2 * LONG_RUN + 3) + [0]
    assert mapping.any_short and mapping.token_slots.tolist() == slots
    mapping.set([1] * 3 + [-1])  # a decode step: no long run, the C kernel takes it all
    assert mapping.long_runs == [] and mapping.short_slots.tolist() == [1, 1, 1, -1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_path_equals_the_reference_with_long_and_short_runs(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    layer = Linear(32, 24, bias=False)
    mapping = LoraMapping(8, torch.device("cpu"))
    method = LoraLinearMethod(
        FloatLinearMethod(),
        in_features=32,
        slice_bounds=[0, 16, 20, 24],
        max_loras=3,
        max_rank=8,
        mapping=mapping,
        dtype=dtype,
        device=torch.device("cpu"),
        kernel="cpu",
    )
    method.lora_a.copy_(torch.randn_like(method.lora_a, dtype=torch.float32))
    method.lora_b.copy_(torch.randn_like(method.lora_b, dtype=torch.float32))
    slots = [1] * (LONG_RUN + 5) + [0, 2, -1, 2] + [2] * LONG_RUN + [-1, 0]
    mapping.set(slots)
    x = torch.randn(len(slots), 32)
    got = method.apply(layer, x)
    want = x @ layer.weight.T + lora_delta_reference(
        x, method.lora_a, method.lora_b, [0, 16, 20, 24], mapping.token_slots
    )
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
