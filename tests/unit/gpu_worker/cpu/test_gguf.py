"""The GGUF block-format kernels (gpu_worker/cpu/gguf.py, gguf.c) against gguf-py's own
`gguf.quants.dequantize` followed by a float64 matmul.

Error bounds. The int8 kernel rounds each row of x to int8 per block of 32 values with scale
d = max|x_block| / 127, so each value moves by at most d / 2 = max|x_block| / 254. The
weight multiplies that error by its *scale part* c = w - offset (offset: the block's min m for
Q4_1/Q5_1, -dmin * m for Q4_K/Q5_K sub-blocks, 0 otherwise; the kernel multiplies the offset
by the exact float sum of x). So |y - y_ref| <= sum_i |c_i| * max|x_block(i)| / 254, plus float
rounding (1e-5 of sum |x| |w|). With activations that int8 holds exactly (integers times a
power of two, each block reaching +-127) only float rounding remains: that tight test catches
any wrong scale, min, nibble or bit. The float path and the dequantization are float-exact up
to rounding.

Each case runs for this CPU's build and an AVX2-only build (-march=haswell, the AMD EPYC
machines of this kind), and a baseline x86-64 build (no AVX2: the float path).
"""

from __future__ import annotations

import platform

import gguf
import numpy as np
import pytest
import torch

from common.cpu_features import cpu_flags
from gpu_worker.cpu import gguf as gguf_cpu
from gpu_worker.cpu.gguf import GgufKernels

T = gguf.GGMLQuantizationType
SMALL_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
K_TYPES = [T.Q4_K, T.Q5_K, T.Q6_K]
# SmolLM2-135M's (out, in): qkv/o 576, k/v 192 (= 3 * 64), MLP 1536; K-quants need in % 256
SMALL_SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (40, 96)]  # 96: odd blocks
K_SHAPES = [(576, 1536), (192, 1536), (64, 512)]
ROWS = [1, 3, 8, 17, 64]

pytestmark = pytest.mark.skipif(gguf_cpu.load() is None, reason="no C compiler here")


def _kernels() -> dict[str, GgufKernels]:
    kernels = {"native": GgufKernels()}
    if platform.machine() == "x86_64" and "avx2" in cpu_flags():
        kernels["avx2"] = GgufKernels("haswell")
        kernels["x86-64"] = GgufKernels("x86-64")
    return kernels


KERNELS = _kernels()


def random_weight(qtype: int, out: int, inn: int, seed: int) -> np.ndarray:
    """GGUF bytes [out, row_bytes] of a random matrix: gguf-py's quantizer for the 32-value
    types; for K-quants (gguf-py cannot quantize them) random bytes with small, finite fp16
    d and dmin."""
    rng = np.random.default_rng(seed)
    values, size = gguf.GGML_QUANT_SIZES[T(qtype)]
    if values == 32:
        w = (rng.standard_normal((out, inn)) * 0.05).astype(np.float32)
        return np.ascontiguousarray(gguf.quants.quantize(w, T(qtype)))
    blocks = rng.integers(0, 256, (out, inn // values, size), dtype=np.uint8)

    def half(scale: float) -> np.ndarray:
        h = (rng.random((out, inn // values, 1)) * scale + scale / 10).astype(np.float16)
        return h.view(np.uint8)

    if qtype == T.Q6_K:
        blocks[..., 208:210] = half(1e-3)
    else:
        blocks[..., 0:2], blocks[..., 2:4] = half(1e-3), half(1e-3)
    return blocks.reshape(out, -1)


def offsets(w: np.ndarray, qtype: int, inn: int) -> np.ndarray:
    """Each 32-value block's offset (w = c + offset), float64 [out, in / 32]."""
    out = w.shape[0]
    values, size = gguf.GGML_QUANT_SIZES[T(qtype)]
    blocks = w.reshape(out, inn // values, size)
    if qtype in (T.Q4_1, T.Q5_1):
        return blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    if qtype in (T.Q4_K, T.Q5_K):
        dmin = blocks[..., 2:4].copy().view(np.float16).astype(np.float64)  # [out, nb, 1]
        _, m = gguf.quants.Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12).copy())
        return (-dmin * m.reshape(out, -1, 8)).reshape(out, -1)
    return np.zeros((out, inn // 32))


def reference(w: np.ndarray, qtype: int, dtype: type = np.float64) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(w, T(qtype)).astype(dtype))


def int8_bound(x: torch.Tensor, w: np.ndarray, qtype: int, ref: torch.Tensor) -> torch.Tensor:
    """The most the int8 kernel may differ from x @ ref.T (module docstring)."""
    rows, inn = x.shape
    c = ref - torch.from_numpy(offsets(w, qtype, inn)).to(ref.dtype).repeat_interleave(32, dim=1)
    err = x.to(ref.dtype).abs().reshape(rows, -1, 32).amax(-1) / 254
    return err.repeat_interleave(32, dim=1) @ c.abs().T * 1.01 + rounding(x, ref)


def rounding(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return 1e-5 * (x.to(ref.dtype).abs() @ ref.abs().T) + 1e-6


def exact_int8_rows(rows: int, inn: int, seed: int) -> torch.Tensor:
    """x that int8 per 32 values holds exactly: integers in [-127, 127] times 2^-7, each
    block reaching 127."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-127, 128, (rows, inn // 32, 32), generator=gen).float()
    x[..., 5] = 127.0
    return (x * 2.0**-7).reshape(rows, inn)


def check(y: torch.Tensor, y_ref: torch.Tensor, bound: torch.Tensor) -> None:
    err = (y.double() - y_ref).abs()
    assert y.dtype == torch.float32 and y.shape == y_ref.shape
    assert bool((err <= bound).all()), f"max error {err.max():.3g}, its bound {bound.min():.3g}"


def gemm_types(march: str) -> set[int]:
    """The types the int8 GEMM takes in that build (Q8_0 needs VNNI: maddubs would saturate)."""
    if march == "x86-64":
        return set()
    vnni = march == "native" and bool({"avx512_vnni", "avx_vnni"} & cpu_flags())
    return {T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1} | ({T.Q8_0} if vnni else set())


CASES = [(q, s) for q in SMALL_TYPES for s in SMALL_SHAPES] + [
    (q, s) for q in K_TYPES for s in K_SHAPES
]


@pytest.mark.parametrize("march", list(KERNELS))
@pytest.mark.parametrize("qtype,shape", CASES, ids=[f"{q.name}-{o}x{i}" for q, (o, i) in CASES])
def test_kernels_match_gguf_py(march: str, qtype: int, shape: tuple[int, int]) -> None:
    k, (out, inn) = KERNELS[march], shape
    seed = int(qtype) * 1000 + out + inn
    w = random_weight(qtype, out, inn, seed)
    wt, ref = torch.from_numpy(w), reference(w, qtype)
    scale = float(ref.abs().max())  # one rounding (fma) where gguf-py rounds twice
    torch.testing.assert_close(
        k.dequantize(wt, qtype, out, inn).double(), ref, rtol=1e-6, atol=1e-6 * scale
    )
    gen = torch.Generator().manual_seed(seed)
    bias = torch.randn(out, generator=gen)
    for rows in ROWS:
        x = torch.randn(rows, inn, generator=gen)
        y_ref = x.double() @ ref.T + bias.double()
        check(k.linear_rows(x, wt, qtype, out, inn, bias), y_ref, int8_bound(x, w, qtype, ref))
        y_f32 = k.linear_rows(x, wt, qtype, out, inn, bias, path="f32")
        check(y_f32, y_ref, rounding(x, ref))
        check(k.linear(x, wt, qtype, out, inn, bias), y_ref, int8_bound(x, w, qtype, ref))
        many = k.linear_many(x, wt, qtype, out, inn, bias)
        assert (many is None) == (qtype not in gemm_types(march))
        if many is not None:
            check(many, y_ref, int8_bound(x, w, qtype, ref))
        xe = exact_int8_rows(rows, inn, seed + rows)
        y_exact = xe.double() @ ref.T
        check(k.linear_rows(xe, wt, qtype, out, inn), y_exact, rounding(xe, ref))
        if many is not None:
            check(k.linear_rows(xe, wt, qtype, out, inn, path="many"), y_exact, rounding(xe, ref))


def test_vocabulary_projection() -> None:
    """SmolLM2's tied embedding as the output layer: Q8_0 [49152, 576], as in its GGUF (the
    reference in float32 here, for memory: the bounds keep a 1% margin)."""
    out, inn, qtype = 49152, 576, T.Q8_0
    w = random_weight(qtype, out, inn, 7)
    wt, ref = torch.from_numpy(w), reference(w, qtype, np.float32)
    bias = torch.randn(out, generator=torch.Generator().manual_seed(0))
    for rows in (1, 17):  # the int8 kernel, then dequantization a tile at a time + torch
        x = torch.randn(rows, inn, generator=torch.Generator().manual_seed(rows))
        y_ref = (x @ ref.T + bias).double()
        bound = int8_bound(x, w, qtype, ref).double()
        for k in KERNELS.values():
            check(k.linear(x, wt, qtype, out, inn, bias), y_ref, bound)


@pytest.mark.parametrize("qtype,path", [(T.Q4_1, "rows"), (T.Q6_K, "rows"), (T.Q4_1, "many")])
def test_rows_do_not_depend_on_their_batch(qtype: int, path: str) -> None:
    out, inn = 96, 512
    wt = torch.from_numpy(random_weight(qtype, out, inn, 3))
    x = torch.randn(13, inn, generator=torch.Generator().manual_seed(3))
    k = KERNELS["native"]
    batch = k.linear_rows(x, wt, qtype, out, inn, path=path)
    for r in range(13):
        assert torch.equal(
            batch[r : r + 1], k.linear_rows(x[r : r + 1], wt, qtype, out, inn, path=path)
        )


def round_per_block(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the kernels round it: per 32 values to int8 steps of max|x| / 127."""
    xs = x.double().reshape(x.shape[0], -1, 32)
    d = xs.abs().amax(-1, keepdim=True) / 127
    return (torch.round(xs / torch.where(d > 0, d, torch.ones_like(d))) * d).reshape(x.shape)


# the builds with the int8 paths (x86-64 without AVX2 multiplies in float, unrounded)
@pytest.mark.parametrize("march", [m for m in KERNELS if m != "x86-64"])
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K])
def test_the_int8_paths_compute_the_rounded_activations_times_the_weights(
    march: str, qtype: int
) -> None:
    """Beyond rounding x per 32 values to int8 (each block's min term included: it multiplies
    the same rounded x as the scale term, as llama.cpp's Q8_1 sum), nothing: the kernels equal
    round(x) @ dequantize(W).T to float precision, on the few-row kernel and the GEMM. An exact
    float sum of x in the min term instead made Q4_1 layers 2-3x less accurate."""
    out, inn = 64, 512
    w = random_weight(qtype, out, inn, 9)
    wt, ref = torch.from_numpy(w), reference(w, qtype)
    x = torch.randn(20, inn, generator=torch.Generator().manual_seed(9)) + 0.3
    expected = round_per_block(x) @ ref.T
    scale = (round_per_block(x).abs() @ ref.abs().T).max()
    for rows in (1, 4, 20):  # the few-row kernel, then the GEMM where it takes the type
        y = KERNELS[march].linear(x[:rows], wt, qtype, out, inn)
        assert (y.double() - expected[:rows]).abs().max() <= 1e-5 * scale


@pytest.mark.parametrize("march", list(KERNELS))
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q6_K])
def test_a_row_is_the_same_bits_alone_and_in_any_batch(march: str, qtype: int) -> None:
    """The few-row kernel and the GEMM do the same float operations: a row alone (decode),
    with 3 others, or in a prefill-sized batch gets the same bits from `linear`, so greedy
    tokens never depend on what a sequence is batched with."""
    out, inn = 96, 512
    k = KERNELS[march]
    wt = torch.from_numpy(random_weight(qtype, out, inn, 5))
    x = torch.randn(40, inn, generator=torch.Generator().manual_seed(5))
    whole = k.linear(x, wt, qtype, out, inn)
    for lo, hi in ((0, 1), (7, 8), (3, 7), (9, 19)):  # alone, few rows, the GEMM's sizes
        assert torch.equal(k.linear(x[lo:hi], wt, qtype, out, inn), whole[lo:hi])
    many = k.linear_many(x, wt, qtype, out, inn, None)
    if many is not None:
        assert torch.equal(many, k.linear_rows(x, wt, qtype, out, inn, None))


NATIVE_AMX = KERNELS["native"].amx_available()
needs_amx = pytest.mark.skipif(
    not NATIVE_AMX,
    reason="no AMX int8 tiles here (the CPU lacks amx_int8 / amx_tile, or Linux did not grant "
    "the process the tile state): the AMX GEMM is not built or not taken",
)
# shapes off the AMX tiles' sizes (32 weight rows, 16 x 32 bytes of x a tile): out not a
# multiple of 16 or 32, in an odd number of 32-value blocks; row counts ragged around 32
AMX_SHAPES = [(40, 96), (50, 64), (200, 576), (576, 1536)]
AMX_BATCHES = [(0, 1), (5, 22), (3, 35), (11, 43), (0, 77)]


@needs_amx
@pytest.mark.parametrize("qtype", SMALL_TYPES)
def test_the_amx_gemm_is_the_same_bits_as_the_avx_gemm_and_the_few_row_kernel(qtype: int) -> None:
    """AMX tiles compute each block's integer dot exactly and the same float epilogue in the
    same order: every output equals the AVX GEMM's and the few-row kernel's bits, for a row
    alone and in batches of any size, bias included."""
    k = KERNELS["native"]
    for i, (out, inn) in enumerate(AMX_SHAPES):
        wt = torch.from_numpy(random_weight(qtype, out, inn, 20 + i))
        gen = torch.Generator().manual_seed(20 + i)
        x, bias = torch.randn(77, inn, generator=gen), torch.randn(out, generator=gen)
        amx = k.linear_rows(x, wt, qtype, out, inn, bias, path="amx")
        assert torch.equal(amx, k.linear_rows(x, wt, qtype, out, inn, bias, path="many_avx"))
        assert torch.equal(amx, k.linear_rows(x, wt, qtype, out, inn, bias, path="rows"))
        assert torch.equal(amx, k.linear(x, wt, qtype, out, inn, bias))
        for lo, hi in AMX_BATCHES:
            part = k.linear_rows(x[lo:hi], wt, qtype, out, inn, bias, path="amx")
            assert torch.equal(part, amx[lo:hi])


def test_the_few_row_kernel_takes_twice_the_rows_where_the_gemm_runs_on_amx() -> None:
    """`linear` sends up to 8 rows of Q4_0 / Q4_1 / Q8_0 (4 of the other types) to the
    few-row kernel where the GEMM runs on AVX, 16 where it runs on AMX tiles (the few-row
    kernel is faster there up to 16)."""
    k = KERNELS["native"]
    for qtype in (T.Q4_0, T.Q4_1, T.Q8_0):
        assert k.few_rows(qtype) == (16 if NATIVE_AMX else 8)
    assert k.few_rows(T.Q4_K) == k.few_rows(T.Q5_0) == 4


# builds for other instruction sets than this CPU's, where it can run them: the same bits
OTHER_BUILDS = {
    "haswell": {"avx2", "fma", "f16c"},  # AVX2: 8-lane GEMM, maddubs
    "skylake-avx512": {"avx512f", "avx512bw", "avx512vl"},  # AVX-512 without VNNI
    "icelake-server": {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"},  # VNNI, no AMX
}


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 builds only")
def test_every_build_gives_a_row_the_same_bits() -> None:
    """The few-row kernel and the GEMM of an AVX2, an AVX-512 and an AVX-512 VNNI build give
    this CPU's build's bits (its AMX GEMM where it has one): a model's outputs do not depend
    on the machine's instruction set."""
    builds = {m: GgufKernels(m) for m, need in OTHER_BUILDS.items() if need <= cpu_flags()}
    if not builds:
        pytest.skip("this CPU runs none of the other builds (no AVX2)")
    out, inn = 200, 576
    for qtype in SMALL_TYPES:
        wt = torch.from_numpy(random_weight(qtype, out, inn, 30))
        gen = torch.Generator().manual_seed(30)
        x, bias = torch.randn(45, inn, generator=gen), torch.randn(out, generator=gen)
        native = KERNELS["native"].linear(x, wt, qtype, out, inn, bias)
        for march, k in builds.items():
            assert not k.amx_available()
            assert torch.equal(k.linear_rows(x, wt, qtype, out, inn, bias), native), march
            many = k.linear_many(x, wt, qtype, out, inn, bias)
            if many is not None:  # Q8_0 needs VNNI (maddubs would saturate)
                assert torch.equal(many, native), march


def test_the_gemm_paths_are_named_and_amx_is_refused_where_absent() -> None:
    k = KERNELS["native"]
    wt = torch.from_numpy(random_weight(T.Q4_1, 8, 64, 0))
    with pytest.raises(ValueError, match="path must be one of"):
        k.linear_rows(torch.randn(40, 64), wt, T.Q4_1, 8, 64, path="tiles")
    if not NATIVE_AMX:
        with pytest.raises(ValueError, match="'amx' path does not take"):
            k.linear_rows(torch.randn(40, 64), wt, T.Q4_1, 8, 64, path="amx")
    for march in [m for m in KERNELS if m != "native"]:  # builds without AMX never take it
        assert not KERNELS[march].amx_available()
    if "amx_int8" not in cpu_flags():
        assert not NATIVE_AMX


def test_gguf_linear_takes_any_leading_shape_and_bfloat16() -> None:
    out, inn, qtype = 192, 576, T.Q4_1
    w = random_weight(qtype, out, inn, 11)
    wt, ref = torch.from_numpy(w), reference(w, qtype)
    for rows in (2, 40):  # the int8 kernel, then dequantize + torch.mm
        x = torch.randn(2, rows // 2, inn, generator=torch.Generator().manual_seed(rows))
        y = gguf_cpu.gguf_linear(x.bfloat16(), wt, qtype, out, inn)
        assert y.dtype == torch.bfloat16 and y.shape == (2, rows // 2, out)
        x2 = x.bfloat16().float().reshape(rows, inn)
        y_ref = x2.double() @ ref.T
        bound = int8_bound(x2, w, qtype, ref) + y_ref.abs() * 2.0**-8  # y rounded to bf16
        check(y.float().reshape(rows, out), y_ref, bound)
    torch.testing.assert_close(gguf_cpu.dequantize(wt, qtype, out, inn), ref.float())


def test_supported_types_and_bad_inputs() -> None:
    assert gguf_cpu.supported_types() == frozenset(SMALL_TYPES + K_TYPES)
    assert gguf_cpu.row_bytes(T.Q4_1, 576) == 18 * 20
    wt = torch.from_numpy(random_weight(T.Q4_1, 8, 64, 0))
    x = torch.randn(1, 64)
    with pytest.raises(ValueError):
        gguf_cpu.gguf_linear(x, wt, T.F16, 8, 64)
    with pytest.raises(ValueError):
        gguf_cpu.gguf_linear(x, wt, T.Q4_0, 8, 64)  # Q4_0 rows are 36 bytes, not 40
    with pytest.raises(ValueError):
        gguf_cpu.gguf_linear(torch.randn(1, 96), wt, T.Q4_1, 8, 96)
    assert gguf_cpu.gguf_linear(torch.randn(0, 64), wt, T.Q4_1, 8, 64).shape == (0, 8)
    wk = torch.from_numpy(random_weight(T.Q4_K, 8, 256, 0))
    with pytest.raises(ValueError):  # the GEMM takes the 32-value types only
        KERNELS["native"].linear_rows(torch.randn(9, 256), wk, T.Q4_K, 8, 256, path="many")
