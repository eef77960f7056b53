"""What a `ModelRunner` is built with: one frozen dataclass, made from the config by one function.

`RunnerOptions()` holds the defaults tests and tools start from; `RunnerOptions.from_config`
is the only place the config tree (model, cache, speculative, parallel sections and the
scheduler's preemption mode) is read for the runner, so a new setting reaches it in one edit.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from common.config import Config
from common.lora_config import LoraConfig
from common.topology import own_name
from gpu_worker.distributed.sharding import threads_per_rank
from gpu_worker.distributed.tensor_parallel import TensorParallel
from gpu_worker.kv_quant import resolve_kv_cache_dtype

# the weight and KV dtypes the runner serves (--dtype auto resolves to one of them)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SPECULATIVE_METHODS = ("", "ngram", "draft")


@dataclasses.dataclass(frozen=True)
class RunnerOptions:
    """Every setting of a `ModelRunner` besides its model folder and tensor-parallel group."""

    dtype: str = "float32"  # a DTYPES key
    device: str = "cpu"  # this rank's: cpu, cuda, cuda:N
    block_size: int = 16  # tokens per KV block
    kv_cache_memory_gib: float = 1.0  # the KV budget on the CPU
    kv_cache_dtype: str = "auto"  # auto (dtype) | int8 | fp8 | fp8_e4m3 | fp8_e5m2 (kv_quant.py)
    num_blocks: int | None = None  # exactly this many KV blocks (None: from the budget)
    max_model_len: int | None = None  # None: the model's own limit
    seed: int = 0  # generators of unseeded sampled requests
    attention_backend: str = "torch"  # torch | triton | auto
    num_threads: int | None = None  # torch threads (None: torch's default)
    gpu_memory_utilization: float = 0.9  # the KV budget on CUDA: this share of free memory
    swap_space_gib: float = 0.0  # host memory for swapped-out KV blocks
    # the prefix cache's lower tiers (gpu_worker/kv_tiers.py): host memory, and files in
    # kv_offload_dir (this replica's folder) up to kv_offload_disk_gib
    kv_offload_memory_gib: float = 0.0
    kv_offload_dir: str = ""
    kv_offload_disk_gib: float = 0.0
    enforce_eager: bool | None = None  # None: eager off CUDA, graphs on it
    max_graph_batch_size: int = 64  # largest decode batch captured as a CUDA graph
    speculative: str = ""  # '' | ngram | draft (with draft_model)
    # C kernels for few-row linears on the CPU (gpu_worker/cpu/linear.py); off: torch only
    cpu_kernels: bool = True
    cpu_packed_weights: bool = True  # float32 weights also pre-packed for oneDNN
    # weights and KV cache in transparent huge pages (gpu_worker/cpu/huge_pages.py)
    cpu_huge_pages: bool = True
    # '' or int8: a float checkpoint's linears quantized at load (gpu_worker/model_loader/loader.py)
    quantization: str = ""
    draft_model: str = ""  # the draft model's folder (speculative == "draft")
    prompt_lookup_min: int = 2  # ngram: shortest suffix looked up
    prompt_lookup_max: int = 4  # ngram: longest suffix looked up
    lora: LoraConfig | None = None  # LoRA adapters (None: --enable-lora is off)
    kv_handover: bool = False  # a prefill or decode replica: its blocks move between replicas

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        resolve_kv_cache_dtype(self.kv_cache_dtype)  # a ValueError naming the field
        draft = self.speculative == "draft"
        if self.speculative not in SPECULATIVE_METHODS or draft != bool(self.draft_model):
            raise ValueError(
                f"speculative must be '', ngram, or draft with a draft model; got "
                f"{self.speculative!r} with draft model {self.draft_model!r}"
            )

    @classmethod
    def from_config(cls, config: Config, tp: TensorParallel | None = None) -> RunnerOptions:
        """The options the worker serves with: every model, cache and speculative setting
        comes from `config`, here and nowhere else (`tp`: this rank's group)."""
        m, c, spec = config.model, config.cache, config.speculative
        swap = config.scheduler.preemption_mode == "swap"
        device, threads = rank_device_and_threads(config, tp or TensorParallel())
        return cls(
            dtype=m.resolved_dtype,
            device=device,
            block_size=c.block_size,
            kv_cache_memory_gib=c.kv_cache_memory,
            kv_cache_dtype=c.kv_cache_dtype,
            gpu_memory_utilization=c.gpu_memory_utilization,
            max_model_len=m.max_model_len or None,
            seed=m.seed,
            attention_backend=m.attention_backend,
            enforce_eager=m.enforce_eager or None,
            max_graph_batch_size=m.max_graph_batch_size,
            num_threads=threads,
            swap_space_gib=c.swap_space if swap else 0.0,
            kv_offload_memory_gib=c.kv_offload_memory,
            # each data-parallel replica its own tier: its own folder (worker, worker-1, ...)
            kv_offload_dir=(
                str(Path(c.kv_offload_dir).expanduser() / own_name(config, "worker"))
                if c.kv_offload_dir
                else ""
            ),
            kv_offload_disk_gib=c.kv_offload_disk,
            speculative=spec.method,
            cpu_kernels=m.cpu_kernels,
            cpu_packed_weights=m.cpu_packed_weights,
            cpu_huge_pages=m.cpu_huge_pages,
            quantization=m.quantization,
            draft_model=str(Path(spec.draft_model).expanduser()) if spec.draft_model else "",
            prompt_lookup_min=spec.prompt_lookup_min,
            prompt_lookup_max=spec.prompt_lookup_max,
            lora=config.lora if config.lora.enable_lora else None,
            kv_handover=config.data_parallel.is_disaggregated,
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def huge_pages(self) -> bool:
        """Huge pages asked for and possible (the CPU only)."""
        return self.cpu_huge_pages and self.torch_device.type == "cpu"

    @property
    def eager(self) -> bool:
        """No CUDA graphs: asked for, or by default anywhere but CUDA."""
        if self.lora is not None:  # graphs would capture the LoRA mapping's state once
            return True
        if self.enforce_eager is None:
            return self.torch_device.type != "cuda"
        return self.enforce_eager

    @property
    def prompt_lookup(self) -> tuple[int, int]:
        """ngram speculation's (shortest, longest) suffix."""
        return self.prompt_lookup_min, self.prompt_lookup_max


DEFAULT_OPTIONS = RunnerOptions()  # (a frozen default for ModelRunner's signature)


def rank_device_and_threads(config: Config, tp: TensorParallel) -> tuple[str, int | None]:
    """This rank's device (cuda:LOCAL_RANK under tensor parallelism on CUDA) and torch
    threads: --num-threads, else with several ranks on a host each takes cores / ranks."""
    device, threads = config.model.device, config.model.num_threads or None
    if tp.size == 1:
        return device, threads
    per_host = config.parallel.ranks_per_node
    if device == "cuda":
        device = f"cuda:{tp.rank % per_host}"
    if threads is None:
        threads = threads_per_rank(len(os.sched_getaffinity(0)), per_host)
    return device, threads
