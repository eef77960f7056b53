"""The KV pool (gpu_worker/runner/kv_pool.py): its budget per device, the draft model's share of it,
and the blocks a model's layout gets from the options."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.distributed.tensor_parallel import TensorParallel
from gpu_worker.model_loader.hf_folder import read_hf_config
from gpu_worker.models.llama_config import LlamaConfig
from gpu_worker.runner import kv_pool
from gpu_worker.runner.kv_pool import allocate_kv_pool, draft_kv_share, kv_budget_bytes
from gpu_worker.runner.options import RunnerOptions
from tests.tiny_models import make_tiny_model

# the tiny llama: 2 layers, 2 KV heads of 16; qwen2: 2 layers, 1 KV head of 16
PER_BLOCK = 2 * 2 * 4 * 2 * 16 * 4  # layers, K/V, block of 4, KV heads, head size, fp32


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {
        arch: str(make_tiny_model(root / arch, arch, num_layers=2)) for arch in ("llama", "qwen2")
    }


def _config(folder: str) -> LlamaConfig:
    return LlamaConfig.from_hf(read_hf_config(folder))


def test_the_kv_budget_on_cuda_is_the_utilization_of_free_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[float] = []

    def free_share(device: torch.device, utilization: float) -> int:
        seen.append(utilization)
        return int(1000 * utilization)

    monkeypatch.setattr(kv_pool, "cuda_kv_budget_bytes", free_share)
    assert kv_budget_bytes(torch.device("cuda"), 1.0, 0.5, share=0.5) == 250
    assert seen == [0.5]
    assert kv_budget_bytes(torch.device("cpu"), 0.5, 0.9) == 1 << 29


def test_the_draft_model_takes_its_bytes_per_block_share(folders: dict[str, str]) -> None:
    target = _config(folders["llama"])
    assert draft_kv_share(target, "", 1) == 0.0
    assert draft_kv_share(target, folders["qwen2"], 1) == pytest.approx(1 / 3)  # 1 : 2 heads
    assert draft_kv_share(target, folders["qwen2"], 2) == pytest.approx(1 / 2)  # 1 head a rank
    assert draft_kv_share(target, folders["llama"], 1) == pytest.approx(1 / 2)


def test_the_pool_holds_the_blocks_of_its_budget_or_exactly_those_asked(
    folders: dict[str, str],
) -> None:
    config = _config(folders["llama"])
    memory = 64 * PER_BLOCK / (1 << 30)  # 64 blocks' worth
    sized = RunnerOptions(block_size=4, kv_cache_memory_gib=memory)
    pool = allocate_kv_pool(config, sized, TensorParallel())
    assert pool.num_blocks == 64 and pool.tensor.shape == (2, 2, 64, 4, 2, 16)
    drafted = RunnerOptions(
        block_size=4, kv_cache_memory_gib=memory, speculative="draft", draft_model=folders["qwen2"]
    )
    assert allocate_kv_pool(config, drafted, TensorParallel()).num_blocks == 42  # 2/3 of 64
    exact = RunnerOptions(block_size=4, num_blocks=5, kv_cache_memory_gib=1e-9)
    assert allocate_kv_pool(config, exact, TensorParallel()).num_blocks == 5
    with pytest.raises(ValueError, match="holds no block"):
        allocate_kv_pool(config, RunnerOptions(kv_cache_memory_gib=1e-9), TensorParallel())


def test_a_windowed_model_gets_layer_groups_and_blocks_of_one_group(tmp_path) -> None:
    """Gemma 3's 5 sliding : 1 global: 6 groups of one layer, so a block is one layer's
    and the same memory holds 6 times the blocks; the tiers, a draft model and prefill/
    decode replicas keep the dense layout (they move a block as every layer's)."""
    config = _config(str(make_tiny_model(tmp_path / "gemma3", "gemma3")))
    options = RunnerOptions(block_size=4, kv_cache_memory_gib=1 / 1024)
    groups = kv_pool.kv_layer_groups(config, options)
    assert groups is not None and groups.windows == (0, 16, 16, 16, 16, 16)
    assert groups.num_slots == 1
    grouped = allocate_kv_pool(config, options, TensorParallel(), groups)
    dense = allocate_kv_pool(config, options, TensorParallel())
    assert grouped.tensor.shape[0] == 1 and dense.tensor.shape[0] == 6
    assert grouped.num_blocks == 6 * dense.num_blocks + 4  # (1024 // 1 and 1024 // 6)
    for other in (
        {"kv_offload_memory_gib": 0.5},
        {"kv_offload_dir": "/tmp/x"},
        {"kv_handover": True},
    ):
        assert kv_pool.kv_layer_groups(config, RunnerOptions(**other)) is None
    assert kv_pool.kv_layer_groups(_config_of_llama(tmp_path), options) is None


def _config_of_llama(tmp_path) -> LlamaConfig:
    return _config(str(make_tiny_model(tmp_path / "llama", "llama")))
