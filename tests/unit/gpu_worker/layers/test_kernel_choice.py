"""KernelChoice's LoRA kernel: the C one beside the C linears, Triton beside Triton's."""

from __future__ import annotations

import torch

from gpu_worker.cpu import lora
from gpu_worker.layers.kernel_choice import TORCH_KERNELS, KernelChoice, choose_kernels


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
