"""Kernel tests: on a machine without CUDA they run under Triton's interpreter on the CPU.

TRITON_INTERPRET is read when `@triton.jit` decorates a kernel, so it is set here, before
any test module imports a `kernel.py`. With CUDA present the kernels compile and run on it.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """make(arch): a tiny random model of tests/tiny_models.py as an HF folder, made once."""
    from tests.tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    return lambda arch: make_tiny_model(root / arch, arch)


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_dir):
    """2 layers, 4 heads / 2 KV heads, head_dim 16."""
    return tiny_model_dir("llama")
