"""The CPU's one-call decode step as a model's `decode_step` (models/llama.py's DecodeStep):
a decode step of a few sequences through every decoder layer in one C call
(gpu_worker/cpu/decode_step.c, the kernel; this module reads the model for it).

Layer by layer from Python, a decode step of one sequence spends ~6 ms of its ~25 ms in torch
dispatch, tensor bookkeeping and ~10 ctypes calls per layer (tools/benchmarks/step_account.py);
the C loop runs the same kernels (linear.c, gguf.c, int8.c, layers.c, cpu_paged_decode.c) in
the same order with the same arithmetic, so its hidden states equal the layer-by-layer
path's exactly.

`decode_step_for(model)` is the model's `decode_step` (chosen at load by
gpu_worker/layers/kernel_choice.py): it takes the C loop for a decode-only step of at most
linear.MAX_ROWS sequences (per weight dtype) and returns None otherwise, so the model runs
its layers (prefill and extend chunks, larger batches, speculative verification). Only a
model of the shape the kernels take: float32 or bfloat16 activations on the CPU with the C
layer ops and linear methods with C kernels (float, GGUF, int8), one tensor-parallel rank,
no per-head q/k norm, the torch attention backend with its C decode kernel.

LoRA: a layer whose method is a LoraLinearMethod with the "cpu" kernel gives the step its base
method's weight and its adapter slots; the step passes the model's LoraMapping's slots to the C
loop when a row has an adapter (lora.c adds the deltas after each base kernel, as the layers
do) and NULL when none has (nothing more to run). The "torch" LoRA kernel keeps the layers.

A bfloat16 model keeps float32 activations between the kernels inside the loop (torch's bf16
layers round every op's output to bf16): its hidden states equal the layer-by-layer path's
only within bf16's precision, and are closer to the float32 model's.
"""

from __future__ import annotations

import ctypes
from typing import cast

import torch
from torch import nn

from gpu_worker.attention import AttentionMetadata
from gpu_worker.attention.torch_backend import TorchAttentionBackend
from gpu_worker.cpu import linear
from gpu_worker.cpu.decode_step import (
    LIN_BF16,
    LIN_F32,
    LIN_GGUF,
    LIN_INT8,
    MAX_SHARDS,
    DecodeLayer,
    DecodeLinear,
    load,
)
from gpu_worker.cpu.layers import CpuLayerOps
from gpu_worker.layers.linear import Linear
from gpu_worker.layers.linear_methods.cpu_float import CpuFloatLinearMethod
from gpu_worker.layers.linear_methods.gguf import GGUFLinearMethod
from gpu_worker.layers.linear_methods.int8 import Int8LinearMethod
from gpu_worker.lora.layer import LoraLinearMethod, LoraMapping
from gpu_worker.models.llama import DecoderLayer, LlamaForCausalLM, LlamaModel, RotaryEmbedding


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _layers(model: LlamaModel) -> list[DecoderLayer]:
    return [cast(DecoderLayer, layer) for layer in model.layers]


def _float32(t: torch.Tensor | None, keep: list[torch.Tensor]) -> torch.Tensor | None:
    """t as a contiguous float32 tensor (a copy, kept alive in `keep`, when it is not)."""
    if t is None or (t.dtype == torch.float32 and t.is_contiguous()):
        return t
    copy = t.detach().to(torch.float32).contiguous()
    keep.append(copy)
    return copy


def _linear(layer: Linear, keep: list[torch.Tensor]) -> DecodeLinear | None:
    """The descriptor of one linear layer for its method's C kernel (and its LoRA slots'), or
    None when its method has none (the step then runs layer by layer)."""
    method = layer.method
    desc = DecodeLinear(nshards=1, b=_ptr(_float32(layer.bias, keep)))
    if isinstance(method, LoraLinearMethod):
        if method.kernel != "cpu":  # the layers' own arithmetic would differ from lora.c's
            return None
        _set_lora(desc, method)
        method = method.base
    if isinstance(method, CpuFloatLinearMethod) and layer.weight.is_contiguous():
        desc.kind = LIN_BF16 if layer.weight.dtype == torch.bfloat16 else LIN_F32
        desc.w[0] = layer.weight.data_ptr()
    elif isinstance(method, GGUFLinearMethod) and method.kernel == "cpu":
        shards = method.shards(layer)
        if len(shards) > MAX_SHARDS:
            return None
        desc.kind, desc.nshards = LIN_GGUF, len(shards)
        for s, (w, qtype, rows) in enumerate(zip(shards, method.qtypes, method.rows, strict=True)):
            desc.w[s], desc.qtype[s], desc.rows[s] = w.data_ptr(), qtype, rows
    elif isinstance(method, Int8LinearMethod) and method.kernel == "cpu":
        desc.kind = LIN_INT8
        desc.w[0] = layer.weight.data_ptr()
        desc.scale = layer.get_parameter("weight_scale").data_ptr()
    else:
        return None
    return desc


def _set_lora(desc: DecodeLinear, method: LoraLinearMethod) -> None:
    """The LoRA slots of a layer into its descriptor: lora.c's a, b and slice bounds."""
    a, b = method.lora_a, method.lora_b
    desc.lora_a, desc.lora_b, desc.lora_bounds = a.data_ptr(), b.data_ptr(), _ptr(method.bounds)
    desc.lora_bf16 = int(a.dtype == torch.bfloat16)
    desc.lora_loras, desc.lora_slices, desc.lora_rank = a.shape[0], a.shape[1], a.shape[2]


def lora_mapping(model: LlamaModel) -> LoraMapping | None:
    """The mapping the model's LoRA layers share (enable_lora's), or None without LoRA."""
    method = _layers(model)[0].self_attn.qkv_proj.method
    return method.mapping if isinstance(method, LoraLinearMethod) else None


def _weights_key(model: LlamaModel) -> tuple[int, int]:
    """What the descriptors point at: the first weight, and the first LoRA slots if any (a
    new key after the weights are swapped or LoRA is enabled)."""
    qkv = _layers(model)[0].self_attn.qkv_proj
    method = qkv.method
    lora = method.lora_a.data_ptr() if isinstance(method, LoraLinearMethod) else 0
    return qkv.weight.data_ptr(), lora


def _layer_pointers(
    model: LlamaModel, keep: list[torch.Tensor]
) -> ctypes.Array[DecodeLayer] | None:
    """Every layer's descriptor, in order: the linears' weights as their methods keep them,
    the norms' weights and the biases in float32 (copies kept in `keep` for a bf16 model);
    None when a linear's method has no kernel here."""
    layers = _layers(model)
    table = (DecodeLayer * len(layers))()
    for slot, layer in zip(table, layers, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        slot.input_norm = _ptr(_float32(layer.input_layernorm.weight, keep))
        slot.post_norm = _ptr(_float32(layer.post_attention_layernorm.weight, keep))
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        for name, linear_layer in zip(("qkv", "o", "gate_up", "down"), linears, strict=True):
            desc = _linear(linear_layer, keep)
            if desc is None:
                return None
            setattr(slot, name, desc)
    return table


class CpuDecodeStep:
    """The model's `decode_step` (models/llama.py's DecodeStep): a decode-only step of at
    most linear.MAX_ROWS sequences through every layer in one C call. Holds the layers'
    weight pointers, built once per weights."""

    _pointers: ctypes.Array[DecodeLayer] | None = None
    _weights_at: tuple[int, int] = (0, 0)
    _float32_copies: list[torch.Tensor]  # a bf16 model's norms, biases and rotary tables
    _rope: tuple[torch.Tensor, torch.Tensor]

    def forward(
        self,
        model: LlamaModel,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor | None:
        n = input_ids.shape[0]
        dtype = kv_cache.dtype
        if (
            meta.num_decodes != meta.num_reqs
            or n > linear.MAX_ROWS.get(dtype, 0)
            or not kv_cache.is_contiguous()
        ):
            return None
        x = model.embed_tokens(input_ids).to(torch.float32).contiguous()
        if self._decode(model, x, positions, kv_cache, meta):
            return x.to(dtype)
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def _decode(
        self,
        model: LlamaModel,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> bool:
        """All layers over x in place; False (x untouched or the step redone by the caller)
        when the kernel refuses."""
        lib = load()
        layer = _layers(model)[0]
        attn = layer.self_attn
        first = _weights_key(model)
        if lib is None or kv_cache.dtype not in (torch.float32, torch.bfloat16):
            return False
        if self._pointers is None or self._weights_at != first:  # built once per weights
            self._float32_copies = []
            self._pointers = _layer_pointers(model, self._float32_copies)
            self._weights_at = first
            keep = self._float32_copies
            self._rope = tuple(_float32(t, keep) for t in model.rotary.tables())  # type: ignore[assignment]  # two tensors in, two out
        if self._pointers is None:
            return False
        cos, sin = self._rope
        tables, lens = meta.block_tables, meta.seq_lens
        assert tables.dtype == torch.int32 and lens.dtype == torch.int32
        slots, pos = meta.slot_mapping, positions.to(torch.int64).contiguous()
        n, hidden = x.shape
        backend = attn.backend
        assert isinstance(backend, TorchAttentionBackend)
        mapping = lora_mapping(model)
        lora_slots = None
        if mapping is not None and mapping.active:
            assert mapping.num_tokens == n, "the LoRA mapping is not this step's"
            lora_slots = mapping.buffer.data_ptr()
        code = lib.decode_forward(
            self._pointers,
            len(model.layers),
            x.data_ptr(),
            n,
            hidden,
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
            layer.mlp.down_proj.in_features,
            layer.input_layernorm.eps,
            cos.data_ptr(),
            sin.data_ptr(),
            pos.data_ptr(),
            slots.data_ptr(),
            kv_cache.data_ptr(),
            kv_cache.stride(0),
            kv_cache.stride(1),
            tables.data_ptr(),
            tables.stride(0),
            lens.data_ptr(),
            meta.block_size,
            backend.scale,
            int(kv_cache.dtype == torch.bfloat16),
            lora_slots,
            torch.get_num_threads(),
        )
        return code == 0


def can_use(model: nn.Module) -> bool:
    """Whether `model` is of the shape decode_step.c takes (see the module docstring)."""
    if not isinstance(model, LlamaForCausalLM) or model.tp.size != 1:
        return False
    if not isinstance(model.model.ops, CpuLayerOps) or not _one_float_dtype(model):
        return False
    inner = model.model
    if not isinstance(inner.rotary, RotaryEmbedding) or not inner.rotary.is_neox_style:
        return False
    for layer in _layers(inner):
        attn = layer.self_attn
        backend = attn.backend
        if (
            attn.q_norm is not None
            or not isinstance(backend, TorchAttentionBackend)
            or not backend.cpu_decode_kernel
            or not all(
                _linear(m, []) is not None
                for m in (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            )
        ):
            return False
    return True


def _one_float_dtype(model: nn.Module) -> bool:
    """Every float parameter float32, or every one bfloat16 (quantized weights aside): the
    models the kernels take."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    return dtypes in ({torch.float32}, {torch.bfloat16})


def decode_step_for(model: nn.Module) -> CpuDecodeStep | None:
    """The one-call decode step for `model`, or None when it is not of a shape the kernel
    takes or the library cannot be had."""
    if not can_use(model) or load() is None:
        return None
    return CpuDecodeStep()
