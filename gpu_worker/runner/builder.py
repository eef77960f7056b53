"""How the runner builds a model version's weights: this rank's shard of a model with the
kernels chosen for the runner's options, an attention backend for its heads, LoRA slots
when adapters are enabled, and huge pages for its memory.

    load_weights(path, hf_config, options, ...)   -> (backend, model)

The runner calls it for its first model and, through `ModelVersions.load`
(gpu_worker/runner/versions.py), for every hot-swapped one; the checkpoint itself is read by
gpu_worker/model_loader/loader.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from gpu_worker.attention import AttentionBackend, create_backend, resolve_backend_name
from gpu_worker.cpu.huge_pages import use_huge_pages
from gpu_worker.distributed.tensor_parallel import TensorParallel
from gpu_worker.layers.kernel_choice import choose_kernels
from gpu_worker.layers.linear import quantization_of, resident_weight_bytes
from gpu_worker.model_loader.loader import check_tensor_parallel, load_model, stores_quantized
from gpu_worker.models.llama import LlamaForCausalLM
from gpu_worker.models.llama_config import LlamaConfig
from gpu_worker.runner.options import RunnerOptions

log = logging.getLogger(__name__)


def load_weights(
    path: str,
    hf_config: dict[str, Any],
    options: RunnerOptions,
    *,
    tp: TensorParallel,
    max_model_len: int,
    progress: Callable[[str], None],
    attach_lora: Callable[[LlamaForCausalLM, str], object] | None = None,
) -> tuple[AttentionBackend, LlamaForCausalLM]:
    """This rank's shard of the model at `path` (`hf_config`: its config.json, as the caller
    read it), and an attention backend for its heads: batch-invariant for a model whose
    linears quantize activations (the torch backend on the CPU: a chunk's queries by the
    decode kernel, so a rounding to int8 never depends on the chunking). `progress` hears its
    stages; `attach_lora(model, lora_kernel)` gives the model its LoRA layers
    (gpu_worker/lora/)."""
    config = LlamaConfig.from_hf(hf_config)
    check_tensor_parallel(config, tp.size, path)
    if attach_lora is not None and config.moe is not None:
        raise ValueError(
            f"--enable-lora: {path} is a mixture of experts ({config.model_type}); LoRA "
            "adapters are served on dense models only"
        )
    device, dtype = options.torch_device, options.torch_dtype
    name = resolve_backend_name(options.attention_backend, device)
    quantized = stores_quantized(path, hf_config, options.quantization)
    kv_quantized = options.kv_cache_dtype != "auto"
    backend = create_backend(
        name,
        num_heads=config.num_heads // tp.size,
        num_kv_heads=config.num_kv_heads // tp.size,
        head_dim=config.head_dim,
        dtype=dtype,
        device=device,
        kv_cache_dtype=options.kv_cache_dtype,
        **config.attention_options(),
        # quantized weights round activations per row; a quantized KV cache rounds each
        # stored row: either way every query row goes through the decode kernel, so a
        # token's attention is the same bits however its prompt was chunked or batched
        **({"batch_invariant": True} if name == "torch" and (quantized or kv_quantized) else {}),
    )
    progress("choosing kernels (the C kernels are built by gcc on first use)")
    kernels = choose_kernels(
        device=device,
        backend_name=backend.name,
        dtype=dtype,
        cpu_kernels=options.cpu_kernels,
        cpu_packed_weights=options.cpu_packed_weights,
    )
    progress(f"reading weights from {path} ({kernels.describe()})")
    model = load_model(
        path,
        backend,
        hf_config=hf_config,
        dtype=dtype,
        device=device,
        max_positions=max_model_len,
        tp=tp,
        kernels=kernels,
        quantization=options.quantization,
    )
    log.info(
        "model %s: %.1f MB of weights resident (%s), %s",
        path,
        resident_weight_bytes(model) / 1e6,
        quantization_of(model) or "float",
        kernels.describe(),
    )
    if attach_lora is not None:
        attach_lora(model, kernels.lora_kernel)
    if options.huge_pages:
        use_huge_pages(model)
    return backend, model
