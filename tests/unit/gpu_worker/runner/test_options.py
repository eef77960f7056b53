"""RunnerOptions (gpu_worker/runner/options.py): each config field's way into the runner's
options, the defaults a bare config gives, and the refusals the runner relied on."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from common.config import Config, ConfigError
from gpu_worker.distributed.tensor_parallel import TensorParallel
from gpu_worker.runner.options import DEFAULT_OPTIONS, RunnerOptions

# (config section, field, value) -> (options field, what it becomes)
MAPPING: list[tuple[str, str, Any, str, Any]] = [
    ("model", "dtype", "bfloat16", "dtype", "bfloat16"),
    ("model", "device", "cuda", "device", "cuda"),
    ("model", "max_model_len", 300, "max_model_len", 300),
    ("model", "seed", 9, "seed", 9),
    ("model", "num_threads", 3, "num_threads", 3),
    ("model", "attention_backend", "triton", "attention_backend", "triton"),
    ("model", "enforce_eager", True, "enforce_eager", True),
    ("model", "cpu_kernels", False, "cpu_kernels", False),
    ("model", "cpu_packed_weights", False, "cpu_packed_weights", False),
    ("model", "cpu_huge_pages", False, "cpu_huge_pages", False),
    ("model", "quantization", "int8", "quantization", "int8"),
    ("model", "max_graph_batch_size", 12, "max_graph_batch_size", 12),
    ("cache", "block_size", 32, "block_size", 32),
    ("cache", "kv_cache_memory", 0.3, "kv_cache_memory_gib", 0.3),
    ("cache", "gpu_memory_utilization", 0.6, "gpu_memory_utilization", 0.6),
    ("speculative", "speculative", "ngram", "speculative", "ngram"),
    ("speculative", "prompt_lookup_min", 3, "prompt_lookup_min", 3),
    ("speculative", "prompt_lookup_max", 7, "prompt_lookup_max", 7),
]


@pytest.mark.parametrize(("section", "field", "value", "option", "expected"), MAPPING)
def test_each_config_field_reaches_its_option_and_only_it(
    section: str, field: str, value: Any, option: str, expected: Any
) -> None:
    bare = RunnerOptions.from_config(Config())
    options = RunnerOptions.from_config(Config().replace(**{section: {field: value}}))
    assert getattr(options, option) == expected != getattr(bare, option)
    assert dataclasses.replace(options, **{option: getattr(bare, option)}) == bare


def test_a_bare_config_leaves_unset_what_the_runner_decides() -> None:
    options = RunnerOptions.from_config(Config())
    unset = {"max_model_len": None, "num_threads": None, "enforce_eager": None}
    assert {name: getattr(options, name) for name in unset} == unset  # 0 / False: "not set"
    assert options.num_blocks is None  # always sized from the budget when served
    assert options.swap_space_gib == 0.0  # preemption by recompute holds no host blocks
    assert options.attention_backend == "auto" and options.speculative == ""
    assert RunnerOptions() == DEFAULT_OPTIONS  # ModelRunner's default: the documented values
    assert (DEFAULT_OPTIONS.dtype, DEFAULT_OPTIONS.attention_backend) == ("float32", "torch")


def test_swap_space_is_reserved_only_for_preemption_by_swap() -> None:
    config = Config().replace(cache={"swap_space": 0.5})
    assert RunnerOptions.from_config(config).swap_space_gib == 0.0
    swap = config.replace(scheduler={"preemption_mode": "swap"})
    assert RunnerOptions.from_config(swap).swap_space_gib == 0.5


def test_each_data_parallel_replica_has_its_own_kv_offload_folder() -> None:
    config = Config().replace(
        cache={"kv_offload_memory": 1.0, "kv_offload_dir": "/kv", "kv_offload_disk": 2.0}
    )
    options = RunnerOptions.from_config(config)
    assert (options.kv_offload_memory_gib, options.kv_offload_disk_gib) == (1.0, 2.0)
    assert options.kv_offload_dir == "/kv/worker"
    second = config.replace(data_parallel={"data_parallel_size": 2, "replica_index": 1})
    assert RunnerOptions.from_config(second).kv_offload_dir == "/kv/worker-1"
    assert RunnerOptions.from_config(Config()).kv_offload_dir == ""


@pytest.mark.parametrize(
    "cache",
    [
        {"kv_offload_dir": "/kv"},  # no disk size
        {"kv_offload_disk": 1.0},  # no folder
        {"kv_offload_dir": "/kv", "kv_offload_disk": 1.0},  # no host memory to read through
        {"kv_offload_memory": 1.0, "enable_prefix_caching": False},
        {"kv_offload_memory": -1.0},
    ],
)
def test_kv_offload_settings_that_cannot_work_are_refused_by_name(cache: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="--kv-offload-"):
        Config().replace(cache=cache)


def test_a_draft_model_alone_means_draft_speculation_at_its_expanded_path() -> None:
    options = RunnerOptions.from_config(Config().replace(speculative={"draft_model": "~/d"}))
    assert options.speculative == "draft"
    assert options.draft_model == str(Path("~/d").expanduser())


def test_a_tensor_parallel_rank_takes_its_device_and_a_share_of_the_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    config = Config().replace(model={"device": "cuda"}, parallel={"tensor_parallel_size": 2})
    options = RunnerOptions.from_config(config, TensorParallel(rank=1, size=2))
    assert (options.device, options.num_threads) == ("cuda:1", 2)
    assert RunnerOptions.from_config(config).device == "cuda"  # no group: the plain device


@pytest.mark.parametrize(
    "bad",
    [
        {"dtype": "float16"},
        {"speculative": "draft"},  # without a draft model
        {"speculative": "ngram", "draft_model": "/d"},
        {"draft_model": "/d"},  # a draft model without draft speculation
        {"speculative": "medusa"},
    ],
)
def test_settings_the_runner_cannot_serve_are_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="dtype|speculative"):
        RunnerOptions(**bad)


def test_derived_settings_follow_the_device() -> None:
    cpu, cuda = RunnerOptions(), RunnerOptions(device="cuda:1")
    assert (cpu.eager, cuda.eager) == (True, False)  # graphs by default on CUDA only
    assert RunnerOptions(device="cuda", enforce_eager=True).eager
    assert (cpu.huge_pages, cuda.huge_pages) == (True, False)
    assert not RunnerOptions(cpu_huge_pages=False).huge_pages
    assert cuda.torch_device == torch.device("cuda", 1)
    assert RunnerOptions(dtype="bfloat16").torch_dtype == torch.bfloat16
    assert RunnerOptions(prompt_lookup_min=1, prompt_lookup_max=3).prompt_lookup == (1, 3)


def test_a_prefill_or_decode_replica_hands_its_kv_over() -> None:
    config = Config().replace(data_parallel={"prefill_replicas": 1, "decode_replicas": 1})
    assert RunnerOptions.from_config(config).kv_handover
    assert not RunnerOptions.from_config(
        Config().replace(data_parallel={"data_parallel_size": 2})
    ).kv_handover
