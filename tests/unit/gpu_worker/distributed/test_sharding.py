"""Tensor-parallel sharding math (gpu_worker/distributed/sharding.py), the sharded weight reads of
the loader, and the refusal of models whose heads do not split over --tensor-parallel-size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from common.config import Config, ConfigError
from gpu_worker.distributed.sharding import (
    Split,
    check_divisible,
    even_range,
    fused_ranges,
    shard_range,
    split_of,
    threads_per_rank,
    vocab_range,
    vocab_shard_size,
)
from gpu_worker.distributed.tensor_parallel import TensorParallel
from gpu_worker.model_loader.loader import read_weights
from services.worker_group import check_parallel, rank_name, rank_specs


@pytest.mark.parametrize(
    ("name", "split"),
    [
        ("model.layers.3.self_attn.q_proj.weight", Split.COLUMN),
        ("model.layers.3.self_attn.k_proj.bias", Split.COLUMN),
        ("model.layers.0.self_attn.v_proj.weight", Split.COLUMN),
        ("model.layers.0.mlp.gate_proj.weight", Split.COLUMN),
        ("model.layers.0.mlp.up_proj.weight", Split.COLUMN),
        ("model.layers.0.self_attn.o_proj.weight", Split.ROW),
        ("model.layers.0.self_attn.o_proj.bias", Split.ROW_BIAS),
        ("model.layers.0.mlp.down_proj.weight", Split.ROW),
        ("model.embed_tokens.weight", Split.VOCAB),
        ("lm_head.weight", Split.VOCAB),
        ("model.layers.0.input_layernorm.weight", Split.REPLICATED),
        ("model.layers.0.self_attn.q_norm.weight", Split.REPLICATED),
        ("model.norm.weight", Split.REPLICATED),
        # int8 compressed-tensors layers
        ("model.layers.0.self_attn.q_proj.weight_scale", Split.COLUMN),
        ("model.layers.0.mlp.up_proj.weight_packed", Split.COLUMN),
        ("model.layers.0.mlp.up_proj.weight_shape", Split.REPLICATED),
        ("model.layers.0.self_attn.o_proj.weight_scale", Split.REPLICATED),
        ("model.layers.0.mlp.down_proj.weight_zero_point", Split.REPLICATED),
        ("model.layers.0.mlp.down_proj.weight_packed", Split.ROW),
        ("model.layers.0.mlp.down_proj.weight_shape", Split.REPLICATED),
        # mixtures of experts: each expert like a dense MLP, the routers replicated
        ("model.layers.1.mlp.experts.7.gate_proj.weight", Split.COLUMN),
        ("model.layers.1.mlp.experts.7.up_proj.weight", Split.COLUMN),
        ("model.layers.1.mlp.experts.7.down_proj.weight", Split.ROW),
        ("model.layers.1.block_sparse_moe.experts.3.w1.weight", Split.COLUMN),
        ("model.layers.1.block_sparse_moe.experts.3.w3.weight", Split.COLUMN),
        ("model.layers.1.block_sparse_moe.experts.3.w2.weight", Split.ROW),
        ("model.layers.1.block_sparse_moe.gate.weight", Split.REPLICATED),
        ("model.layers.1.mlp.gate.weight", Split.REPLICATED),
        ("model.layers.1.mlp.shared_expert.gate_proj.weight", Split.COLUMN),
        ("model.layers.1.mlp.shared_expert_gate.weight", Split.REPLICATED),
        # Phi-3's fused projections: each part split
        ("model.layers.0.self_attn.qkv_proj.weight", Split.FUSED),
        ("model.layers.0.mlp.gate_up_proj.weight", Split.FUSED),
        # gpt-oss: stacked experts [E, in, out] (float) or [E, out, groups, 16] (MXFP4)
        ("model.layers.0.mlp.experts.gate_up_proj", Split.DIM2),
        ("model.layers.0.mlp.experts.gate_up_proj_bias", Split.ROW),
        ("model.layers.0.mlp.experts.down_proj", Split.ROW),
        ("model.layers.0.mlp.experts.down_proj_bias", Split.ROW_BIAS),
        ("model.layers.0.mlp.experts.gate_up_proj_blocks", Split.ROW),
        ("model.layers.0.mlp.experts.gate_up_proj_scales", Split.ROW),
        ("model.layers.0.mlp.experts.down_proj_blocks", Split.DIM2),
        ("model.layers.0.mlp.experts.down_proj_scales", Split.DIM2),
        ("model.layers.0.mlp.router.weight", Split.REPLICATED),
        ("model.layers.0.self_attn.sinks", Split.COLUMN),
    ],
)
def test_each_checkpoint_tensor_has_its_split(name: str, split: Split) -> None:
    assert split_of(name) is split


def test_even_ranges_tile_the_dimension() -> None:
    assert [even_range(12, r, 3) for r in range(3)] == [(0, 4), (4, 8), (8, 12)]
    with pytest.raises(ValueError, match="does not divide"):
        even_range(10, 0, 3)
    with pytest.raises(ValueError, match="rank 3"):
        even_range(12, 3, 3)


def test_vocab_shards_are_equal_and_the_last_is_padded() -> None:
    assert vocab_shard_size(10, 3) == 4
    assert [vocab_range(10, r, 3) for r in range(3)] == [(0, 4), (4, 8), (8, 10)]
    assert vocab_range(49152, 2, 3) == (32768, 49152)  # SmolLM2's vocabulary splits evenly
    assert [vocab_range(2, r, 3) for r in range(3)] == [(0, 1), (1, 2), (2, 2)]
    # heads: 9 heads of 64 split over 3 ranks are rows [192 r, 192 (r + 1)) of q_proj
    assert shard_range(Split.COLUMN, (576, 576), 1, 3) == (192, 384)
    assert shard_range(Split.ROW, (576, 576), 2, 3) == (384, 576)


def test_heads_that_do_not_divide_are_refused_naming_the_flag_and_numbers() -> None:
    check_divisible(3, num_heads=9, num_kv_heads=3, intermediate_size=1536)
    with pytest.raises(ValueError) as e:
        check_divisible(2, num_heads=9, num_kv_heads=3, intermediate_size=1536, model="smol")
    msg = str(e.value)
    assert "--tensor-parallel-size 2" in msg
    assert "attention heads (num_attention_heads) = 9" in msg
    assert "KV heads (num_key_value_heads) = 3" in msg
    assert "intermediate_size" not in msg.split(";")[0]  # 1536 divides: not named as a fault
    with pytest.raises(ValueError, match="KV heads .* = 1"):
        check_divisible(2, num_heads=4, num_kv_heads=1, intermediate_size=160)


def test_serve_refuses_a_model_that_does_not_split(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 96})
    )
    config = Config().replace(model={"model": str(tmp_path)}, parallel={"tensor_parallel_size": 2})
    with pytest.raises(ConfigError, match="--tensor-parallel-size 2 does not divide"):
        check_parallel(config, tmp_path)
    check_parallel(config.replace(parallel={"tensor_parallel_size": 3}), tmp_path)
    both = config.replace(
        parallel={"tensor_parallel_size": 3}, data_parallel={"data_parallel_size": 2}
    )
    with pytest.raises(ConfigError, match="with --data-parallel-size > 1 is not supported"):
        check_parallel(both, tmp_path)


def test_parallel_flags_are_checked() -> None:
    with pytest.raises(ConfigError, match="--nnodes"):
        Config().replace(parallel={"tensor_parallel_size": 3, "nnodes": 2})
    with pytest.raises(ConfigError, match="--dist-init-addr"):
        Config().replace(parallel={"tensor_parallel_size": 4, "nnodes": 2})
    config = Config().replace(
        parallel={"tensor_parallel_size": 4, "nnodes": 2, "node_rank": 1, "dist_init_addr": "a:1"}
    )
    assert list(config.parallel.local_ranks) == [2, 3]
    assert (
        threads_per_rank(2, 2) == 1 and threads_per_rank(2, 3) == 1 and threads_per_rank(8, 2) == 4
    )


def test_rank_commands_share_one_rendezvous() -> None:
    config = Config().replace(parallel={"tensor_parallel_size": 3})
    specs = rank_specs(config, ["--config-file", "c.json"])
    assert [name for name, _ in specs] == ["worker", "worker-rank-1", "worker-rank-2"]
    addrs = {cmd[cmd.index("--dist-init-addr") + 1] for _, cmd in specs}
    assert len(addrs) == 1 and next(iter(addrs)).startswith("127.0.0.1:")
    assert [cmd[cmd.index("--rank") + 1] for _, cmd in specs] == ["0", "1", "2"]
    assert rank_specs(Config(), [])[0][0] == rank_name(0) == "worker"


def test_each_rank_reads_only_its_slices(tmp_path: Path) -> None:
    torch.manual_seed(0)
    full = {
        "model.embed_tokens.weight": torch.randn(10, 4),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(12, 4),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(4, 12),
        "model.layers.0.self_attn.o_proj.bias": torch.randn(4),
        "model.norm.weight": torch.randn(4),
    }
    save_file(full, str(tmp_path / "model.safetensors"))
    shards = [read_weights(tmp_path, TensorParallel(rank=r, size=3)) for r in range(3)]
    emb = [s["model.embed_tokens.weight"] for s in shards]
    assert all(e.shape == (4, 4) for e in emb)
    assert torch.equal(torch.cat(emb)[:10], full["model.embed_tokens.weight"])
    assert torch.equal(emb[2][2:], torch.zeros(2, 4))  # padding rows
    shards = [read_weights(tmp_path, TensorParallel(rank=r, size=2)) for r in range(2)]
    q = torch.cat([s["model.layers.0.self_attn.q_proj.weight"] for s in shards], dim=0)
    o = torch.cat([s["model.layers.0.self_attn.o_proj.weight"] for s in shards], dim=1)
    assert torch.equal(q, full["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(o, full["model.layers.0.self_attn.o_proj.weight"])
    bias = [s["model.layers.0.self_attn.o_proj.bias"] for s in shards]
    assert torch.equal(bias[0], full["model.layers.0.self_attn.o_proj.bias"])
    assert torch.equal(bias[1], torch.zeros(4))  # added once, after the all-reduce
    assert all(torch.equal(s["model.norm.weight"], full["model.norm.weight"]) for s in shards)


def test_each_rank_takes_its_device_and_a_share_of_the_cores(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from gpu_worker.runner.options import rank_device_and_threads

    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    config = Config().replace(parallel={"tensor_parallel_size": 2})
    assert rank_device_and_threads(config, TensorParallel()) == ("cpu", None)
    assert rank_device_and_threads(config, TensorParallel(rank=1, size=2)) == ("cpu", 2)
    cuda = config.replace(model={"device": "cuda", "num_threads": 3})
    assert rank_device_and_threads(cuda, TensorParallel(rank=1, size=2)) == ("cuda:1", 3)


def test_fused_ranges_take_each_parts_share() -> None:
    assert fused_ranges((8, 4, 4), 0, 2) == [(0, 4), (8, 10), (12, 14)]
    assert fused_ranges((8, 4, 4), 1, 2) == [(4, 8), (10, 12), (14, 16)]
    with pytest.raises(ValueError, match="does not divide"):
        fused_ranges((8, 3, 3), 0, 2)


def test_a_fused_phi3_tensor_splits_as_its_parts_would(tmp_path: Path) -> None:
    """Rank r's rows of Phi-3's qkv_proj are its q rows, then its k, then its v rows: what
    concatenating its slices of separate q/k/v projections gives (GQA: 4 heads, 2 KV)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(8, 4), torch.randn(4, 4), torch.randn(4, 4)
    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    full = {
        "model.layers.0.self_attn.qkv_proj.weight": torch.cat([q, k, v]),
        "model.layers.0.mlp.gate_up_proj.weight": torch.cat([gate, up]),
    }
    save_file(full, str(tmp_path / "model.safetensors"))
    fused = {"qkv_proj": (8, 4, 4), "gate_up_proj": (6, 6)}
    for r in range(2):
        shard = read_weights(tmp_path, TensorParallel(rank=r, size=2), fused)
        qkv = [t[r * t.shape[0] // 2 : (r + 1) * t.shape[0] // 2] for t in (q, k, v)]
        gate_up = [t[r * 3 : (r + 1) * 3] for t in (gate, up)]
        assert torch.equal(shard["model.layers.0.self_attn.qkv_proj.weight"], torch.cat(qkv))
        assert torch.equal(shard["model.layers.0.mlp.gate_up_proj.weight"], torch.cat(gate_up))
    with pytest.raises(ValueError, match="part sizes are not known"):
        read_weights(tmp_path, TensorParallel(rank=0, size=2))
