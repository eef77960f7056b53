"""The disk tier's files: a checked header and checksum, background writes that a read sees
before they land, and a start-up scan that keeps this model's and layout's files only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.messages import StepPlan
from gpu_worker.distributed.tensor_parallel import TensorParallel
from gpu_worker.kv_cache import KVCache
from gpu_worker.kv_tiers import CorruptBlock, DiskTier, KVTierStore, decode_block, file_name

SHAPE = (2, 2, 4, 1, 8)  # layers, K/V, block size, KV heads, head dim
LAYOUT = {"dtype": "float32", "shape": list(SHAPE), "num_layers": 2, "block_size": 4}


def _disk(folder: Path, version: str = "v1", layout: dict | None = None) -> DiskTier:
    return DiskTier(folder, layout or LAYOUT, version, torch.float32)


def test_a_written_block_reads_back_and_a_changed_byte_is_discarded(tmp_path: Path) -> None:
    d = _disk(tmp_path)
    block = torch.randn(SHAPE)
    d.put(-5, [1, 2, 3, 4], block.clone())
    d.flush()
    path = tmp_path / file_name(-5)
    assert path.exists()
    assert torch.equal(d.read(-5, [1, 2, 3, 4]), block)  # type: ignore[arg-type]
    assert d.read(-5, [1, 2, 3, 9]) is None  # other tokens: not this block; deleted
    d.flush()
    assert not path.exists()
    d.put(7, [1], block.clone())
    d.flush()
    data = bytearray((tmp_path / file_name(7)).read_bytes())
    data[-3] ^= 0x40
    (tmp_path / file_name(7)).write_bytes(bytes(data))
    with pytest.raises(CorruptBlock, match="checksum"):
        decode_block(bytes(data), {"key": 7}, torch.float32, SHAPE)
    assert d.read(7, [1]) is None and d.num_discarded == 2
    d.close()


def test_a_read_sees_a_write_still_queued(tmp_path: Path) -> None:
    d = _disk(tmp_path)
    block = torch.randn(SHAPE)
    d._queue.put(("drop", 0))  # (any op ahead of the write)
    d.put(3, [3], block)
    got = d.read(3, [3])
    assert got is not None and torch.equal(got, block)
    d.close()


def test_the_scan_keeps_this_version_and_layout_only(tmp_path: Path) -> None:
    d = _disk(tmp_path, "v1")
    d.put(1, [1], torch.randn(SHAPE))
    d.put(2, [2], torch.randn(SHAPE))
    d.close()
    other = _disk(tmp_path, "v2")  # other weights: their files go
    other.scan(capacity=10)
    assert not other.files and not list(tmp_path.glob("*.kv"))
    other.close()
    d = _disk(tmp_path, "v1")
    d.put(1, [1], torch.randn(SHAPE))
    d.close()
    bf16 = _disk(tmp_path, "v1", {**LAYOUT, "dtype": "bfloat16"})  # another KV dtype
    bf16.scan(capacity=10)
    assert not bf16.files
    bf16.close()
    d = _disk(tmp_path, "v1")
    d.put(1, [1], torch.randn(SHAPE))
    d.put(2, [2], torch.randn(SHAPE))
    d.close()
    again = _disk(tmp_path, "v1")
    again.scan(capacity=10)
    assert dict(again.files) == {1: [1], 2: [2]}
    again.close()


def test_the_store_moves_blocks_in_the_plans_order(tmp_path: Path) -> None:
    kv = KVCache(
        num_layers=2,
        num_blocks=4,
        block_size=4,
        num_kv_heads=1,
        head_dim=8,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    kv.tensor.normal_()
    store = KVTierStore.create(
        kv,
        memory_gib=3 * kv.block_bytes / (1 << 30),
        folder=str(tmp_path),
        disk_gib=1e-3,
        version="v1",
        tp=TensorParallel(),
    )
    assert store is not None and store.num_host_slots == 3
    b1 = kv.tensor[:, :, 1].clone()
    store.apply(StepPlan(step_id=1, tier_save_src=[1], tier_save_dst=[2]))
    assert torch.equal(kv.tier_block(2), b1)
    store.apply(
        StepPlan(step_id=2, tier_spill_slots=[2], tier_spill_keys=[42], tier_spill_tokens=[[9]])
    )
    ok, failed = store.apply(
        StepPlan(
            step_id=3,
            tier_fetch_keys=[42, 43],
            tier_fetch_tokens=[[9], [9]],
            tier_fetch_slots=[0, 1],
        )
    )
    assert ok == [42] and failed == [43]
    assert torch.equal(kv.tier_block(0), b1)
    kv.tier_load([0], [3])
    assert torch.equal(kv.tensor[:, :, 3], b1)
    store.close()
    assert (tmp_path / "rank0of1" / file_name(42)).exists()
