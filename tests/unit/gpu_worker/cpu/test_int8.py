"""The int8 W8A8 CPU linear (gpu_worker/cpu/int8.py, int8.c) against a float32 torch
reference, across its paths (C kernel, oneDNN, torch) and builds (native, AVX2, plain C)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from common.cpu_features import cpu_flags
from gpu_worker.cpu import int8
from gpu_worker.cpu.build import build_flags

pytestmark = pytest.mark.skipif(int8.load() is None, reason="no C compiler here")

# SmolLM2-135M's linear layers [out, in]: qkv, o, gate_up, down, LM head; then awkward ones
SMOLLM2 = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
ODD = [(37, 100), (5, 3), (130, 64), (65, 129)]
# -march of the other builds: AVX2 without VNNI (an AVX2-only EPYC), AVX-VNNI without
# AVX-512 (runs where the CPU has avx_vnni), no SIMD dot product at all
VARIANTS = {"haswell": "avx2", "alderlake": "avx_vnni", "x86-64": "sse2"}


def _weights(out: int, inn: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    wq, ws = int8.quantize_weight(torch.randn(out, inn, generator=gen))
    return wq, ws, torch.randn(out, generator=gen)


def _bound(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """float32 rounding of the reference's and the kernel's sums: 1e-5 of the sum of |terms|"""
    xq, xs = int8.quantize_rows(x)
    terms = (xq.float().abs() * xs[:, None]) @ (wq.float().abs() * ws[:, None]).t()
    return 1e-5 * terms + 1e-6


@pytest.mark.parametrize("shape", SMOLLM2 + ODD)
@pytest.mark.parametrize("rows", [1, 3, 8, 17, 64])
def test_matches_float_reference_on_every_path(shape: tuple[int, int], rows: int) -> None:
    out, inn = shape
    wq, ws, bias = _weights(out, inn, rows + out)
    x = torch.randn(rows, inn, generator=torch.Generator().manual_seed(rows))
    ref = int8.reference_linear(x, wq, ws, bias)
    y = int8.int8_linear(x, wq, ws, bias)
    assert y.shape == (rows, out) and y.dtype == torch.float32
    assert ((y - ref).abs() <= _bound(x, wq, ws)).all()
    # every path gives the same bits: the C kernel, oneDNN's (VNNI CPUs), the torch path (no
    # compiler) with either of its exact sums
    assert torch.equal(int8.int8_linear_torch(x, wq, ws, bias), y)
    packed = int8.pack_weight(wq)
    assert (packed is not None) == int8.can_pack()
    if packed is not None:
        assert torch.equal(int8.int8_linear(x, wq, ws, bias, packed), y)
    xq, _ = int8.quantize_rows(x)
    exact = xq.double() @ wq.double().t()
    for int_mm in [False, True] if int8.can_pack() else [False]:
        assert torch.equal(int8.exact_sums(xq, wq, int_mm), exact.float())


def test_sums_stay_exact_at_the_extremes() -> None:
    """Every product at its largest (127 * -128) over 3000 terms: sums past 2**24, exact."""
    lib = int8.load()
    assert lib is not None
    wq = torch.full((3, 3000), -128, dtype=torch.int8)
    ws, x = torch.ones(3), torch.full((2, 3000), 5.0)
    kernel = torch.empty(2, 3)
    int8._kernel(lib, x, wq, ws, None, kernel)
    assert torch.equal(int8.int8_linear_torch(x, wq, ws, None), kernel)
    assert abs(kernel[0, 0].item() + 128 * 3000 * 5.0) < 1.0  # x = 5 is 127 * (5 / 127)
    xq, _ = int8.quantize_rows(x)
    sums = int8.exact_sums(xq, wq, int_mm=False)
    assert (sums == float(127 * -128 * 3000)).all()


@pytest.mark.parametrize("packed", [False, True])
def test_a_row_does_not_depend_on_its_batch(packed: bool) -> None:
    if packed and not int8.can_pack():
        pytest.skip("oneDNN's int8 GEMM is not used on this CPU (no VNNI)")
    wq, ws, bias = _weights(960, 576, 1)
    pw = int8.pack_weight(wq) if packed else None
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, 576, generator=gen) * torch.rand(64, 1, generator=gen) * 10
    whole = int8.int8_linear(x, wq, ws, bias, pw)  # 64 rows: oneDNN when packed
    for rows in (1, 5, 16):  # the C kernel, alone and beside other rows
        part = int8.int8_linear(x[:rows], wq, ws, bias, pw)
        assert torch.equal(part, whole[:rows])
    other = torch.cat([x[:1], torch.randn(40, 576, generator=gen) * 1000])
    assert torch.equal(int8.int8_linear(other, wq, ws, bias, pw)[0], whole[0])


def _build(march: str, target: Path, source: Path = int8.SOURCE) -> ctypes.CDLL:
    flags = [f"-march={march}" if f == "-march=native" else f for f in build_flags()]
    compiler = shutil.which("gcc") or shutil.which("cc")
    assert compiler is not None
    subprocess.run([compiler, *flags, str(source), "-o", str(target), "-lm"], check=True)
    lib = ctypes.CDLL(str(target))
    int8._declare(lib)
    return lib


@pytest.fixture(scope="module")
def variants(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ctypes.CDLL]:
    """The kernel built for each VARIANTS -march this CPU can run."""
    folder = tmp_path_factory.mktemp("int8_builds")
    flags = cpu_flags()
    libs = {
        march: _build(march, folder / f"int8-{march}.so")
        for march, needs in VARIANTS.items()
        if needs in flags
    }
    # as a one-call step would have it: #included after the float kernels (whose
    # fast-math options must not leak into int8.c's epilogue, nor its options out of it)
    step = folder / "step.c"
    cpu = int8.SOURCE.parent
    step.write_text("".join(f'#include "{cpu / name}"\n' for name in ("linear.c", "int8.c")))
    libs["included"] = _build("native", folder / "step.so", step)
    return libs


@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (3072, 576)] + ODD)
def test_other_builds_give_the_same_bits(
    variants: dict[str, ctypes.CDLL], shape: tuple[int, int]
) -> None:
    assert "haswell" in variants, "the AVX2 build must be tested"
    out, inn = shape
    wq, ws, bias = _weights(out, inn, 3)
    wq[0, : min(inn, 7)] = -128  # a checkpoint may hold -128: no sign flip may overflow
    for rows in (1, 2, 3, 4, 6, 9):
        x = torch.randn(rows, inn, generator=torch.Generator().manual_seed(rows))
        native = int8.int8_linear(x, wq, ws, bias)
        assert torch.equal(native, int8.int8_linear_torch(x, wq, ws, bias))
        for march, lib in variants.items():
            y = torch.empty(rows, out)
            int8._kernel(lib, x, wq, ws, bias, y)
            assert torch.equal(y, native), march


def test_bfloat16_and_leading_dims_and_no_bias() -> None:
    wq, ws, _ = _weights(48, 64, 4)
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    y = int8.int8_linear(x, wq, ws)
    assert y.shape == (2, 3, 48) and y.dtype == torch.bfloat16
    # computed in float32 from x's bf16 values, rounded to bf16 once at the end
    assert torch.equal(y, int8.int8_linear(x.float(), wq, ws).bfloat16())
    ref = int8.reference_linear(x.float(), wq, ws, None).reshape(2, 3, 48)
    torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=1e-3)
    assert int8.int8_linear(x[:0], wq, ws).shape == (0, 3, 48)


def test_an_all_zero_row_gives_the_bias() -> None:
    wq, ws, bias = _weights(20, 32, 5)
    x = torch.zeros(2, 32)
    x[1] = 1.0
    y = int8.int8_linear(x, wq, ws, bias)
    assert torch.equal(y[0], bias)
    assert ((y[1] - int8.reference_linear(x[1:], wq, ws, bias)[0]).abs() < 1e-4).all()


def test_quantize_weight_is_symmetric_per_row() -> None:
    w = torch.randn(6, 50, generator=torch.Generator().manual_seed(6)) * torch.arange(1, 7)[:, None]
    w[2] = 0.0
    q, scale = int8.quantize_weight(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (6,)
    rows = [0, 1, 3, 4, 5]
    torch.testing.assert_close(scale[rows], w[rows].abs().amax(1) / 127)
    assert (q[rows].abs().amax(1) == 127).all() and (q[2] == 0).all() and q.min() >= -127
    err = (q.float() * scale[:, None] - w).abs()
    assert (err <= scale[:, None] / 2 * (1 + 1e-5)).all()


def test_long_rows_sum_exactly() -> None:
    """100000 products: VNNI's offset sums pass 2**31 and wrap; the result stays exact."""
    wq = torch.full((2, 100_000), 127, dtype=torch.int8)
    wq[1] = -128
    x = torch.full((1, 100_000), 3.0)
    y = int8.int8_linear(x, wq, torch.ones(2))
    assert y[0, 0].item() == pytest.approx(127 * 100_000 * 3.0, rel=1e-6)
    assert y[0, 1].item() == pytest.approx(-128 * 100_000 * 3.0, rel=1e-6)
    assert torch.equal(y, int8.int8_linear_torch(x, wq, torch.ones(2), None))
    with pytest.raises(ValueError, match="int32"):
        int8.int8_linear(
            torch.ones(1, 200_000), torch.ones(1, 200_000, dtype=torch.int8), torch.ones(1)
        )


def test_bad_weights_are_refused() -> None:
    with pytest.raises(ValueError, match="int8"):
        int8.int8_linear(torch.randn(2, 8), torch.randn(4, 8), torch.ones(4))
    with pytest.raises(ValueError, match="features"):
        int8.int8_linear(torch.randn(2, 9), torch.zeros(4, 8, dtype=torch.int8), torch.ones(4))
