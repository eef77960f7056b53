"""Decode graphs: a padded bucket computes what the unpadded batch does (CPU, interpreter),
and captured graphs replay like the eager model (CUDA only)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from gpu_worker.attention import build_metadata  # noqa: E402
from gpu_worker.runner.cuda_graphs import CUDAGraphRunner, DecodeGraphInputs, run_model  # noqa: E402
from gpu_worker.runner.model_runner import ModelRunner  # noqa: E402
from gpu_worker.runner.options import RunnerOptions  # noqa: E402

BLOCK_SIZE = 4


def _runner(path, device: torch.device) -> ModelRunner:
    options = RunnerOptions(device=str(device), num_blocks=32, block_size=BLOCK_SIZE,
                            max_model_len=64, attention_backend="triton")  # fmt: skip
    runner = ModelRunner(str(path), options)
    # random K/V, as if earlier steps had filled the cache
    gen = torch.Generator().manual_seed(0)
    kv = runner.kv_cache.tensor
    kv.copy_(torch.randn(kv.shape, generator=gen).to(kv.device))
    return runner


def _decode_batch(n: int, device: torch.device):
    """n decodes with contexts 1..n*3 over scattered blocks, and their token ids."""
    seq_lens = [1 + 3 * i for i in range(n)]
    tables, next_block = [], 0
    for seq_len in seq_lens:
        num_blocks = -(-seq_len // BLOCK_SIZE)
        tables.append([(next_block + j) * 7 % 32 for j in range(num_blocks)])
        next_block += num_blocks
    meta = build_metadata([s - 1 for s in seq_lens], [1] * n, tables, BLOCK_SIZE, device)
    return torch.arange(100, 100 + n, device=device), meta


@torch.inference_mode()
def test_padded_bucket_computes_what_the_batch_does(tiny_llama, device) -> None:
    runner = _runner(tiny_llama, device)
    input_ids, common = _decode_batch(3, device)
    meta = runner.backend.build_metadata(common)
    kv = runner.kv_cache.tensor
    kv_before = kv.clone()
    eager = runner.model(input_ids, meta.positions, kv, meta, torch.arange(3, device=device))
    kv_eager = kv.clone()
    kv.copy_(kv_before)
    # what a bucket-8 graph runs: the batch in rows 0..2, padding in rows 3..7
    inputs = DecodeGraphInputs.allocate(8, max_blocks=16, device=device)
    inputs.fill(input_ids, common, bucket=8)
    padded_meta = runner.backend.build_metadata(inputs.metadata(8, BLOCK_SIZE))
    padded = runner.model(inputs.input_ids[:8], inputs.positions[:8], kv, padded_meta,
                          inputs.logits_indices[:8])  # fmt: skip
    assert (padded[:3] - eager).abs().max().item() <= 1e-4
    _assert_same_writes(kv, kv_eager, kv_before)


def _assert_same_writes(kv: torch.Tensor, kv_eager: torch.Tensor, before: torch.Tensor) -> None:
    """The padded run wrote the batch's slots (to rounding) and nothing else."""
    assert torch.equal(kv != before, kv_eager != before)
    assert (kv - kv_eager).abs().max().item() <= 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@torch.inference_mode()
def test_graph_replay_matches_eager(tiny_llama) -> None:
    device = torch.device("cuda")
    runner = _runner(tiny_llama, device)
    graphs = CUDAGraphRunner(runner.model, runner.backend, runner.kv_cache.tensor,
                             block_size=BLOCK_SIZE, max_model_len=64,
                             max_graph_batch_size=16)  # fmt: skip
    graphs.capture()
    assert sorted(graphs.graphs) == [1, 2, 4, 8, 16]
    kv = runner.kv_cache.tensor
    for n in (1, 3, 9):
        input_ids, common = _decode_batch(n, device)
        meta = runner.backend.build_metadata(common)
        indices = torch.arange(n, device=device)
        kv_before = kv.clone()
        eager = runner.model(input_ids, meta.positions, kv, meta, indices).clone()
        kv_eager = kv.clone()
        kv.copy_(kv_before)
        assert graphs.can_run(meta)
        replayed, _ = run_model(runner.model, graphs, input_ids, kv, meta, indices)
        assert (replayed - eager).abs().max().item() <= 1e-3
        _assert_same_writes(kv, kv_eager, kv_before)
