"""The C small-batch linear kernel (gpu_worker/cpu/linear.py) and the CPU float linear method
(gpu_worker/layers/linear_methods/cpu_float.py) against torch's F.linear."""

from __future__ import annotations

import ctypes
import platform

import pytest
import torch
import torch.nn.functional as F

from common.cpu_features import cpu_flags
from gpu_worker.cpu import linear
from gpu_worker.cpu.build import KernelLibrary
from gpu_worker.layers.linear import FloatLinearMethod, Linear, LinearMethod
from gpu_worker.layers.linear_methods.cpu_float import CpuFloatLinearMethod

pytestmark = pytest.mark.skipif(linear.load() is None, reason="no C compiler here")


@pytest.mark.parametrize("rows", [1, 2, 5, 8])
@pytest.mark.parametrize("shape", [(960, 576), (577, 1536), (3, 7), (130, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_float32_matches_torch(rows: int, shape: tuple[int, int], bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows * 7 + shape[0])
    w = torch.randn(shape, generator=gen)
    b = torch.randn(shape[0], generator=gen) if bias else None
    x = torch.randn(rows, shape[1], generator=gen)
    y = linear.linear_small(x, w, b)
    assert y is not None and y.dtype == torch.float32 and y.shape == (rows, shape[0])
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 4])
def test_bfloat16_weights_accumulate_in_float32(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(200, 320, generator=gen).bfloat16()
    x = torch.randn(rows, 320, generator=gen).bfloat16()
    b = torch.randn(200, generator=gen).bfloat16()
    y = linear.linear_small(x, w, b)
    assert y is not None and y.dtype == torch.bfloat16
    exact = F.linear(x.float(), w.float(), b.float())
    torch.testing.assert_close(y, exact.bfloat16(), rtol=0, atol=0)


def test_inputs_it_does_not_take_fall_back() -> None:
    w = torch.randn(16, 8)
    assert linear.linear_small(torch.randn(9, 8), w, None) is None  # > 8 rows: torch's GEMM
    assert linear.linear_small(torch.randn(0, 8), w, None) is None
    assert linear.linear_small(torch.randn(5, 8).bfloat16(), w.bfloat16(), None) is None
    assert linear.linear_small(torch.randn(2, 8), w.t().contiguous().t(), None) is None
    assert linear.linear_small(torch.randn(2, 8), w.half(), None) is None


def _layer(in_features: int, out_features: int, bias: bool, method: LinearMethod) -> Linear:
    """A Linear with random float weights given to `method`, as the loader gives them."""
    gen = torch.Generator().manual_seed(in_features * 31 + out_features)
    layer = Linear(in_features, out_features, bias)
    w = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
    b = torch.randn(out_features, generator=gen) if bias else None
    layer.method = method
    method.load_weights(layer, w, b)
    method.process_weights_after_loading(layer)
    return layer


def test_the_cpu_method_equals_torch_for_few_and_many_rows() -> None:
    layer = _layer(8, 16, True, CpuFloatLinearMethod())
    reference = _layer(8, 16, True, FloatLinearMethod())
    for rows in (3, 40):  # the C kernel; oneDNN packed
        x = torch.randn(rows, 8)
        torch.testing.assert_close(layer(x), reference(x), rtol=1e-5, atol=1e-5)
    assert "CpuFloatLinearMethod" in repr(layer)  # what runs is visible in the model


@pytest.mark.skipif(not linear.can_pack(torch.float32), reason="torch without oneDNN")
@pytest.mark.parametrize("rows", [9, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_many_rows_take_the_packed_weight_and_match_torch(rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    method = CpuFloatLinearMethod()
    layer = _layer(577, 130, bias, method)
    x = torch.randn(rows, 577, generator=gen)
    expected = F.linear(x, layer.weight, layer.bias)
    assert method.packed is not None
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-4)
    # any leading shape: a prefill's [tokens, in] or [batch, tokens, in]
    torch.testing.assert_close(layer(x.view(rows, 1, 577)), expected.view(rows, 1, 130))
    unpacked = CpuFloatLinearMethod(pack=False)
    _layer(3, 4, True, unpacked)
    assert unpacked.packed is None


def _gemm_builds() -> dict[str, ctypes.CDLL]:
    """linear.c for this CPU and, on an AVX2 machine, for AVX2 alone and for plain x86-64:
    each build's tiles differ (AVX-512 12 rows x 32 outputs, AVX2 6 x 16, scalar)."""
    builds = {"native": linear.load()}
    if platform.machine() == "x86_64" and "avx2" in cpu_flags():
        for march in ("haswell", "x86-64"):
            builds[march] = KernelLibrary(
                linear.SOURCE, linear._declare, "linear.c", (linear.SOURCE.with_name("bf16.h"),),
                march=march,
            ).load()  # fmt: skip
    return {k: lib for k, lib in builds.items() if lib is not None}


GEMM_BUILDS = _gemm_builds()


def _gemm(lib: ctypes.CDLL, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    y = torch.empty(x.shape[0], w.shape[0])
    x, panels = x.contiguous(), linear.pack_panels(w)
    code = lib.linear_gemm(
        x.data_ptr(), x.shape[0], panels.data_ptr(), b.data_ptr(), y.data_ptr(), w.shape[0],
        w.shape[1], 2,
    )  # fmt: skip
    assert code == 0
    return y


@pytest.mark.parametrize("march", list(GEMM_BUILDS))
@pytest.mark.parametrize("shape", [(1024, 512), (70, 37), (13, 16), (96, 200), (48, 5)])
def test_the_gemm_gives_each_row_the_same_bits_alone_and_in_any_batch(
    march: str, shape: tuple[int, int]
) -> None:
    """linear_gemm: every output the same bits whatever the rows beside it (register tiles of
    every row count, a last panel part empty, an odd last panel), close to torch, and the same
    bits on every build (AVX-512, AVX2 and the scalar chain run one chain of fused
    multiply-adds an output)."""
    lib, (out, inn) = GEMM_BUILDS[march], shape
    gen = torch.Generator().manual_seed(3)
    w, b = torch.randn(out, inn, generator=gen), torch.randn(out, generator=gen)
    x = torch.randn(41, inn, generator=gen)
    batch = _gemm(lib, x, w, b)
    torch.testing.assert_close(batch, F.linear(x, w, b), rtol=1e-4, atol=1e-4)
    for i in (0, 5, 40):
        assert torch.equal(_gemm(lib, x[i : i + 1], w, b)[0], batch[i]), i
    perm = torch.randperm(41, generator=gen)[:7]
    assert torch.equal(_gemm(lib, x[perm], w, b), batch[perm])
    assert torch.equal(_gemm(GEMM_BUILDS["native"], x, w, b), batch)


def test_panels_unpack_to_the_weight() -> None:
    w = torch.randn(2, 37, 9)
    panels = linear.pack_panels(w)
    assert panels.shape == (2, 3, 9, linear.PANEL)
    assert torch.equal(linear.unpack_panels(panels, 37), w)
    assert not panels[:, 2, :, 5:].any()  # outputs past 37: zero


def test_linear_gemm_wrapper_takes_float32_only() -> None:
    if linear.load() is None:
        pytest.skip("linear.c cannot be built here")
    w, x = torch.randn(8, 32), torch.randn(3, 32)
    panels = linear.pack_panels(w)
    y = linear.linear_gemm(x, panels, None, 8)
    assert y is not None
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert linear.linear_gemm(x.bfloat16(), panels, None, 8) is None
    assert linear.linear_gemm(x, panels.bfloat16(), None, 8) is None
    assert linear.linear_gemm(x, panels, None, 17) is None  # more outputs than its panels
