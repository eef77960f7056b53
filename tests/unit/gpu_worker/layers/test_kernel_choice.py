"""KernelChoice: the LoRA kernel follows the linears' (the C one beside the C linears, Triton
beside Triton's); each quantized weight gets its method, whose kernel is bound when it is built
(an unknown kernel fails there); the one-call step only where it was chosen."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.cpu import lora
from gpu_worker.layers.kernel_choice import TORCH_KERNELS, KernelChoice, choose_kernels
from gpu_worker.layers.linear import FloatLinearMethod
from gpu_worker.layers.linear_methods.gguf import GGUFLinearMethod
from gpu_worker.layers.linear_methods.int8 import Int8LinearMethod
from gpu_worker.layers.linear_methods.weights import GGUFShard, GGUFWeight, Int8Weight


def test_lora_kernel_follows_the_linears() -> None:
    assert TORCH_KERNELS.lora_kernel == "torch"
    assert KernelChoice(triton_linears=True).lora_kernel == "triton"
    cpu = choose_kernels(device=torch.device("cpu"), backend_name="torch", dtype=torch.float32)
    expected = "cpu" if cpu.cpu_linears and lora.load() is not None else "torch"
    assert cpu.lora_kernel == expected
    no_c = choose_kernels(
        device=torch.device("cpu"), backend_name="torch", dtype=torch.float32, cpu_kernels=False
    )
    assert no_c.lora_kernel == "torch"


def test_each_weight_gets_its_method() -> None:
    gguf = GGUFWeight((GGUFShard(2, torch.zeros(4, 18, dtype=torch.uint8)),), in_features=32)
    int8 = Int8Weight(torch.zeros(4, 32, dtype=torch.int8), torch.ones(4))
    method = TORCH_KERNELS.linear_method(gguf)
    assert isinstance(method, GGUFLinearMethod) and method.kernel == "torch"
    assert isinstance(TORCH_KERNELS.linear_method(int8), Int8LinearMethod)
    assert isinstance(TORCH_KERNELS.linear_method(torch.zeros(4, 32)), FloatLinearMethod)


@pytest.mark.parametrize("method", [GGUFLinearMethod, Int8LinearMethod])
def test_an_unknown_kernel_fails_when_the_method_is_built(method: type) -> None:
    with pytest.raises(ValueError, match="unknown"):
        method("cuda_magic", torch.float32)


def test_no_one_call_step_unless_chosen() -> None:
    assert not TORCH_KERNELS.one_call_step
    assert TORCH_KERNELS.one_call_step_for(None) is None  # type: ignore[arg-type]  # not read
