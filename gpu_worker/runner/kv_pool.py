"""The runner's KV pool, sized from its options once the first model's weights are loaded.

bytes    per block from the KV dtype (--kv-cache-dtype: int8 rows take head_dim + 4 bytes,
         fp8 rows head_dim, float32 4 * head_dim): a quantized pool holds more blocks
budget   CUDA: gpu_memory_utilization of the memory still free after the weights;
         CPU: kv_cache_memory_gib (or exactly num_blocks when the options give it)
share    with a draft model, the draft pool has as many blocks as the target's, so the
         budget is split by their bytes per block
ranks    under tensor parallelism each rank holds its KV heads, and every rank takes the
         number of blocks the tightest rank can hold: one block id means one block
         everywhere
"""

from __future__ import annotations

import torch

from common.kv_groups import LayerGroups, layer_groups
from gpu_worker.distributed.tensor_parallel import TensorParallel
from gpu_worker.kv_cache import GIB, KVCache, bytes_per_block, cuda_kv_budget_bytes
from gpu_worker.model_loader.hf_folder import read_hf_config
from gpu_worker.models.llama_config import LlamaConfig
from gpu_worker.runner.options import RunnerOptions


def kv_budget_bytes(
    device: torch.device, memory_gib: float, gpu_memory_utilization: float, share: float = 1.0
) -> int:
    """`share` of the KV budget: on CUDA, `gpu_memory_utilization` of the memory still free
    once the weights are loaded; elsewhere `memory_gib`."""
    if device.type == "cuda":
        return int(cuda_kv_budget_bytes(device, gpu_memory_utilization) * share)
    return int(memory_gib * GIB * share)


def draft_kv_share(
    config: LlamaConfig,
    draft_model: str,
    tp_size: int,
    kv_cache_dtype: str = "auto",
    dtype: torch.dtype = torch.float32,
) -> float:
    """The draft model's part of the KV budget (0 without one): the pools have as many
    blocks each, so the budget is split by their bytes per block (the draft's KV stays in
    the model's dtype; the target's is stored as `kv_cache_dtype`)."""
    if not draft_model:
        return 0.0
    draft = LlamaConfig.from_hf(read_hf_config(draft_model))
    # this rank's KV heads of the target; the draft model is whole on every rank
    mine = bytes_per_block(
        config.num_layers, 1, config.num_kv_heads // tp_size, config.head_dim, dtype,
        kv_cache_dtype,
    )  # fmt: skip
    theirs = bytes_per_block(draft.num_layers, 1, draft.num_kv_heads, draft.head_dim, dtype)
    return theirs / (mine + theirs)


def kv_layer_groups(config: LlamaConfig, options: RunnerOptions) -> LayerGroups | None:
    """The model's KV layer groups (common/kv_groups.py), or None for the dense layout: a
    model without windows, or one served with what groups do not take yet (the KV tiers,
    keyed by a block's hash alone, a draft model, which reads the target's tables, and
    prefill/decode replicas, whose hand-over moves whole blocks of every layer)."""
    if not config.sliding_windows:
        return None
    if options.kv_offload_memory_gib or options.kv_offload_dir or options.draft_model:
        return None
    if options.kv_handover:
        return None
    return layer_groups(config.sliding_windows, config.num_layers)


def allocate_kv_pool(
    config: LlamaConfig,
    options: RunnerOptions,
    tp: TensorParallel,
    groups: LayerGroups | None = None,
) -> KVCache:
    """The target's pool for a model of `config`: this rank's KV heads, in the blocks the
    options' budget holds after the draft model's share (or exactly `options.num_blocks`).
    With layer groups a block holds one group's layers (`groups.num_slots` of them)."""
    layout = dict(
        num_layers=groups.num_slots if groups is not None else config.num_layers,
        block_size=options.block_size,
        num_kv_heads=config.num_kv_heads // tp.size,
        head_dim=config.head_dim,
    )
    dtype, device = options.torch_dtype, options.torch_device
    num_blocks = options.num_blocks
    if num_blocks is None:
        share = 1 - draft_kv_share(
            config, options.draft_model, tp.size, options.kv_cache_dtype, dtype
        )
        memory, utilization = options.kv_cache_memory_gib, options.gpu_memory_utilization
        budget = kv_budget_bytes(device, memory, utilization, share)
        per_block = bytes_per_block(**layout, dtype=dtype, kv_cache_dtype=options.kv_cache_dtype)
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(f"KV budget of {budget} bytes holds no block of {per_block} bytes")
    return KVCache(
        num_blocks=tp.agree_min(num_blocks),
        dtype=dtype,
        device=device,
        huge_pages=options.huge_pages,
        kv_cache_dtype=options.kv_cache_dtype,
        **layout,
    )
