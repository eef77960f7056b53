"""A quantized KV cache (--kv-cache-dtype int8 / fp8_e4m3 / fp8_e5m2) in the Triton kernels:
the store kernel writes the bits torch's quantization writes (gpu_worker/kv_quant.py), the
paged decode and extend kernels read the quantized blocks as their references read them back
(with windows, soft caps and sinks), and the triton backend agrees with the torch backend
(the CPU's reference backend) on a mixed step. Small shapes: the interpreter is slow."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from gpu_worker.attention import build_metadata, create_backend  # noqa: E402
from gpu_worker.kernels.extend_attention.kernel import extend_attention  # noqa: E402
from gpu_worker.kernels.extend_attention.reference import extend_attention_reference  # noqa: E402
from gpu_worker.kernels.kv_store.kernel import store_kv  # noqa: E402
from gpu_worker.kernels.kv_store.reference import store_kv_reference  # noqa: E402
from gpu_worker.kernels.paged_decode.kernel import paged_decode  # noqa: E402
from gpu_worker.kernels.paged_decode.reference import paged_decode_reference  # noqa: E402
from gpu_worker.kv_quant import KVFormat  # noqa: E402
from tests.kernels.paged import paged_batch, randn  # noqa: E402

FORMATS = ["int8", "fp8_e4m3", "fp8_e5m2"]
SINKS = [2.0, -3.0, 0.0, 6.0, 1.5, -0.5]


def _quantized_batch(name: str, seq_lens: list[int], device: torch.device):
    fmt = KVFormat.create(name, torch.float32)
    batch = paged_batch(seq_lens, block_size=16, num_kv_heads=2, head_dim=64)
    batch.kv_cache = fmt.quantize(batch.kv_cache * 3).to(device)
    batch.block_tables, batch.seq_lens = batch.block_tables.to(device), batch.seq_lens.to(device)
    return batch


@pytest.mark.parametrize("name", FORMATS)
def test_store_writes_the_bits_torch_writes(name: str, device: torch.device) -> None:
    fmt = KVFormat.create(name, torch.float32)
    k = randn(6, 2, 64, seed=0) * torch.logspace(-7, 3, 6)[:, None, None]  # subnormals to big
    k[1, 0, :4] = torch.tensor([0.5 * 2**-9, 1.5 * 2**-9, 1000.0, -70000.0])  # ties, clamps
    k[2, 1] = 0.0  # an all-zero row
    v = randn(6, 2, 64, seed=1)
    slots = torch.tensor([0, 5, -1, 7, 11, 2])
    cache = torch.zeros(2, 3, 4, 2, fmt.row_width(64), dtype=fmt.storage_dtype)
    ref = cache.clone()
    store_kv_reference(k, v, ref, slots, name)
    cache = cache.to(device)
    store_kv(k.to(device), v.to(device), cache, slots.to(device), name)
    assert torch.equal(cache.cpu(), ref)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("variant", ["plain", "window_softcap_sinks"])
def test_paged_decode_reads_quantized_blocks(name: str, variant: str, device) -> None:
    batch = _quantized_batch(name, [1, 15, 16, 17, 70], device)
    q = randn(5, 6, 64, seed=2, device=device)
    extra = dict(window=9, softcap=5.0, sinks=torch.tensor(SINKS, device=device))
    kw = extra if variant != "plain" else {}
    out = paged_decode(q, batch.kv_cache, batch.block_tables, batch.seq_lens, 0.3,
                       num_splits=4, kv_cache_dtype=name, **kw)  # fmt: skip
    ref = paged_decode_reference(q, batch.kv_cache, batch.block_tables, batch.seq_lens, 0.3,
                                 kv_cache_dtype=name, **kw)  # fmt: skip
    assert (out - ref).abs().max().item() <= 2e-3


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("variant", ["plain", "window_softcap_sinks"])
def test_extend_reads_quantized_blocks(name: str, variant: str, device) -> None:
    batch = _quantized_batch(name, [9, 40, 20], device)
    qsl = torch.tensor([0, 9, 21, 22], dtype=torch.int32, device=device)  # 9, 12, 1 new
    q = randn(22, 6, 64, seed=3, device=device)
    extra = dict(window=9, softcap=5.0, sinks=torch.tensor(SINKS, device=device))
    kw = extra if variant != "plain" else {}
    out = extend_attention(q, batch.kv_cache, batch.block_tables, qsl, batch.seq_lens, 0.3,
                           max_query_len=12, kv_cache_dtype=name, **kw)  # fmt: skip
    ref = extend_attention_reference(q, batch.kv_cache, batch.block_tables, qsl,
                                     batch.seq_lens, 0.3, kv_cache_dtype=name, **kw)  # fmt: skip
    assert (out - ref).abs().max().item() <= 2e-3


@pytest.mark.parametrize("name", FORMATS)
def test_triton_backend_matches_torch_backend(name: str, device: torch.device) -> None:
    fmt = KVFormat.create(name, torch.float32)
    num_computed, num_new = [15, 1, 0, 5], [1, 1, 9, 4]
    tables = [[3, 7, 10, 11], [0], [5, 1, 9], [2, 8, 4]]
    cache = fmt.quantize(randn(2, 12, 4, 2, 64, seed=0)).to(device)
    tokens = sum(num_new)
    q = randn(tokens, 6, 64, seed=1, device=device)
    k, v = randn(tokens, 2, 64, seed=2, device=device), randn(tokens, 2, 64, seed=3, device=device)
    sinks = torch.tensor(SINKS, device=device)
    outs, caches = [], []
    for backend_name in ("torch", "triton"):
        backend = create_backend(backend_name, num_heads=6, num_kv_heads=2, head_dim=64,
                                 dtype=torch.float32, device=device, softcap=5.0,
                                 kv_cache_dtype=name)  # fmt: skip
        caches.append(cache.clone())
        meta = backend.build_metadata(build_metadata(num_computed, num_new, tables, 4, device))
        outs.append(backend.forward(q, k, v, caches[-1], meta, 6, sinks))
    assert torch.equal(caches[0], caches[1])  # the same quantized bits stored
    assert (outs[0] - outs[1]).abs().max().item() <= 2e-3
