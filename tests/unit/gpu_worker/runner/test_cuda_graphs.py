"""CUDA-graph bucket and padding logic, on the CPU (the capture itself: tests/kernels)."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.attention import build_metadata, create_backend
from gpu_worker.runner.cuda_graphs import (
    PAD_SLOT,
    CUDAGraphRunner,
    DecodeGraphInputs,
    graph_batch_sizes,
    maybe_capture_graphs,
    pick_bucket,
    run_model,
)


def test_buckets_are_powers_of_two_then_steps_of_16() -> None:
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32]
    assert graph_batch_sizes(5) == [1, 2, 4]
    assert graph_batch_sizes(0) == []


def test_a_batch_takes_the_smallest_bucket_that_holds_it() -> None:
    sizes = graph_batch_sizes(48)
    assert [pick_bucket(n, sizes) for n in (1, 3, 8, 9, 17, 48)] == [1, 4, 8, 16, 32, 48]
    assert pick_bucket(49, sizes) is None  # above the largest bucket: eager
    assert pick_bucket(1, []) is None


def _decode_meta(seq_lens: list[int], tables: list[list[int]]):
    return build_metadata([n - 1 for n in seq_lens], [1] * len(seq_lens), tables, 4)


def test_fill_copies_the_batch_and_pads_the_rest_of_the_bucket() -> None:
    inputs = DecodeGraphInputs.allocate(16, max_blocks=8, device="cpu")
    # a larger batch first, so the smaller one must overwrite its leftovers
    big = _decode_meta([5] * 9, [[i, i + 1] for i in range(9)])
    inputs.fill(torch.arange(9), big, bucket=16)
    meta = _decode_meta([2, 9, 4], [[7], [3, 5, 6], [1]])
    inputs.fill(torch.tensor([11, 12, 13]), meta, bucket=4)
    assert inputs.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert inputs.positions[:4].tolist() == [1, 8, 3, 0]
    assert inputs.slot_mapping[:4].tolist() == [7 * 4 + 1, 6 * 4 + 0, 1 * 4 + 3, PAD_SLOT]
    assert inputs.seq_lens[:4].tolist() == [2, 9, 4, 1]
    assert inputs.block_tables[:4, :4].tolist() == [
        [7, 0, 0, 0], [3, 5, 6, 0], [1, 0, 0, 0], [0, 0, 0, 0]
    ]  # fmt: skip


def test_metadata_views_the_static_buffers() -> None:
    inputs = DecodeGraphInputs.allocate(8, max_blocks=4, device="cpu")
    meta = inputs.metadata(4, block_size=16)
    assert meta.num_decodes == meta.num_reqs == 4 and meta.num_tokens == 4
    assert meta.slot_mapping.data_ptr() == inputs.slot_mapping.data_ptr()
    assert meta.block_tables.shape == (4, 4)


def test_eager_when_not_on_cuda_or_enforced() -> None:
    backend = create_backend("torch", num_heads=2, num_kv_heads=1, head_dim=8,
                             dtype=torch.float32, device=torch.device("cpu"))  # fmt: skip
    kv = torch.zeros(1, 2, 4, 4, 1, 8)
    kwargs = dict(block_size=4, max_model_len=16, max_graph_batch_size=8)
    identity = torch.nn.Identity()
    for eager in (False, True):  # not enforced: still eager, the tensors are on the CPU
        assert maybe_capture_graphs(identity, backend, kv, enforce_eager=eager, **kwargs) is None
    with pytest.raises(ValueError, match="cannot be captured"):
        CUDAGraphRunner(identity, backend, kv, **kwargs)  # torch: host numbers
    calls = []
    meta = _decode_meta([3], [[0]])
    model = lambda *args: calls.append(args) or torch.ones(1, 5)  # noqa: E731
    logits, _ = run_model(model, None, torch.tensor([1]), kv, meta, torch.tensor([0]))
    assert logits.shape == (1, 5)
    assert len(calls) == 1
