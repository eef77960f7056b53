"""Attention backend names: `auto` picks triton on CUDA (when installed), torch elsewhere."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.attention import create_backend, resolve_backend_name
from gpu_worker.kernels import triton_available


def test_auto_resolves_by_device() -> None:
    assert resolve_backend_name("auto", "cpu") == "torch"
    expected_on_cuda = "triton" if triton_available() else "torch"
    assert resolve_backend_name("auto", torch.device("cuda")) == expected_on_cuda
    assert resolve_backend_name("torch", "cuda") == "torch"
    assert resolve_backend_name("triton", "cpu") == "triton"  # explicit: the backend decides
    with pytest.raises(ValueError, match="unknown attention backend"):
        resolve_backend_name("flash", "cpu")


def test_create_backend_accepts_auto_and_rejects_unknown_names() -> None:
    kwargs = dict(num_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                  device=torch.device("cpu"))  # fmt: skip
    assert create_backend("auto", **kwargs).name == "torch"
    assert not create_backend("torch", **kwargs).supports_cuda_graphs
    with pytest.raises(ValueError, match="unknown attention backend"):
        create_backend("flash", **kwargs)
