"""The CPU's one-call step (`OneCallStep`, a model's `one_call_step`): a decode step of a few
sequences through every decoder layer in one C call (one_call_step.c, built once with gcc and
called via ctypes).

Layer by layer from Python, a decode step of one sequence spends ~6 ms of its ~25 ms in torch
dispatch, tensor bookkeeping and ~10 ctypes calls per layer (tools/benchmarks/step_account.py);
the C loop runs the same kernels (linear.c, gguf.c, int8.c, layers.c, lora.c, paged_decode.c)
in the same order with the same arithmetic, so its hidden states equal the layer-by-layer
path's exactly.

A leaf like the other kernels: it knows the C structs and the shape of a model (the Protocols
of one_call_model.py: `OneCallModel` and its parts, which gpu_worker/models/llama.py's classes
fill), not the model's classes. Each linear layer's method gives its own descriptor
(`LinearMethod.one_call_linear`, gpu_worker/layers/linear.py), built with the constructors
of one_call_descriptors.py (the C structs, and `Keep`), or None when the C loop cannot run
it.

`one_call_step_for(model)` (asked by gpu_worker/layers/kernel_choice.py, beside the C layer
ops only) gives a model of the shape the kernels take its step: float32 or bfloat16
activations on the CPU, one tensor-parallel rank, q/k norms per head (Qwen3) or over the
whole projections (OLMoE) without Gemma's offset, sinks (gpt-oss), neox rotary, the torch
attention backend with its C decode kernel, every linear with a descriptor, and every
mixture of experts' layer with its experts' (`MoEMethod.one_call_experts`: float32 / bf16,
GGUF of one block type per projection, int8 and MXFP4 on their "cpu" kernels; moe.c runs
the router's routing, the experts and Qwen2-MoE's gated shared expert, as the layers' CPU
methods do). A part without a descriptor (experts on torch's or Triton's arithmetic, GGUF
experts of mixed block types, top-k past moe.MAX_TOP_K) keeps the model on its layers. The
step takes a decode-only step of at most linear.MAX_ROWS sequences (per weight dtype), or of
up to one_call_step.c's DECODE_MAX_ROWS where every linear is GGUF blocks without LoRA and
every layer dense (gguf.c's kernels take any rows, on the kernel the layers choose), and
returns None otherwise, so the model runs its layers (prefill and extend chunks, larger
batches, speculative verification).

LoRA: a LoraLinearMethod with the "cpu" kernel gives its base method's descriptor plus its
adapter slots, and the step the model's token slots (`Keep.lora`); the step passes them to the
C loop when a row has an adapter (lora.c adds the deltas after each base kernel, as the layers
do) and NULL when none has. The "torch" LoRA kernel gives no descriptor: the layers run.

A bfloat16 model keeps float32 activations between the kernels inside the loop (torch's bf16
layers round every op's output to bf16): its hidden states equal the layer-by-layer path's
only within bf16's precision, and are closer to the float32 model's.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from gpu_worker.cpu import linear
from gpu_worker.cpu import moe as cpu_moe
from gpu_worker.cpu.build import KernelLibrary
from gpu_worker.cpu.one_call_descriptors import DecodeLayer, DecodeLinear, DecodeMoE, Keep
from gpu_worker.cpu.one_call_model import (
    OneCallLayer,
    OneCallLinear,
    OneCallModel,
    OneCallSparseMLP,
    dense_mlp,
    sparse_mlp,
)

if TYPE_CHECKING:  # annotations only: the attention package imports this one's kernels
    from gpu_worker.attention import AttentionMetadata

_P = ctypes.c_void_p
HERE = Path(__file__).parent
SOURCE = HERE / "one_call_step.c"
INCLUDES = tuple(
    HERE / name
    for name in (
        *("bf16.h", "linear.c", "gguf.c", "gguf.h", "gguf_rows.h", "gguf_gemm.h", "gguf_amx.h"),
        *("int8.c", "layers.c", "lora.c", "paged_decode.c", "moe.c", "mxfp4.c"),
    )
)


def _declare(lib: ctypes.CDLL) -> None:
    i, f, i64 = ctypes.c_int, ctypes.c_float, ctypes.c_int64
    lib.decode_many_rows.restype = i
    lib.decode_many_rows.argtypes = [_P, i]
    lib.decode_forward.restype = i
    lib.decode_forward.argtypes = [
        *(_P, i, _P, i, i, i, i, i, i, i, f),  # layers .. rot, inter, eps
        *(_P, _P, _P, _P, _P, i64, i64),  # cos .. half_stride
        *(_P, i, _P, i, f, i, _P, i),  # tables .. kv_kind, lora_slots, nthreads
        _P,  # groups: per layer (slot, tables, table stride, slot mapping), or NULL
    ]


_LIBRARY = KernelLibrary(SOURCE, _declare, "CPU one-call step kernel", INCLUDES)


def load() -> ctypes.CDLL | None:
    """The kernel library (built on first use), or None when it cannot be had."""
    return _LIBRARY.load()


def _attention_linears(layer: OneCallLayer) -> tuple[OneCallLinear, OneCallLinear]:
    attn = layer.self_attn
    return attn.qkv_proj, attn.o_proj


def _descriptor(layer: OneCallLinear, keep: Keep) -> DecodeLinear | None:
    desc = layer.one_call_linear(keep)
    if desc is not None:
        desc.b = _ptr(keep.float32(layer.bias))
    return desc


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _moe(mlp: OneCallSparseMLP, counts: torch.Tensor, keep: Keep) -> DecodeMoE | None:
    """A sparse MLP's descriptor (its router, routing, experts and shared expert), counting
    its tokens per expert into `counts` [E] int64; None when a part has none."""
    experts, routing = mlp.experts, mlp.experts.routing
    if routing.top_k > cpu_moe.MAX_TOP_K or experts.num_experts > cpu_moe.MAX_EXPERTS:
        return None
    router = _descriptor(mlp.gate, keep)
    desc = experts.method.one_call_experts(experts, keep)
    if router is None or desc is None:
        return None
    moe = DecodeMoE(router=router, experts=desc, top_k=routing.top_k, counts=counts.data_ptr())
    moe.scoring = cpu_moe.SCORINGS[routing.scoring]
    moe.renormalize = int(routing.renormalize)
    shared, gate = mlp.shared_expert, mlp.shared_expert_gate
    if shared is not None and gate is not None:
        gate_up, down = _descriptor(shared.gate_up_proj, keep), _descriptor(shared.down_proj, keep)
        gate_desc = _descriptor(gate, keep)
        if gate_up is None or down is None or gate_desc is None:
            return None
        moe.shared_gate_up, moe.shared_down, moe.shared_gate = gate_up, down, gate_desc
        moe.shared_width = shared.down_proj.in_features
    keep.structs.append(moe)
    return moe


def _mlp(slot: DecodeLayer, layer: OneCallLayer, counts: torch.Tensor, keep: Keep) -> bool:
    """The layer's MLP into slot: a dense one's linears, or a sparse one's DecodeMoE; False
    when a part has no descriptor."""
    dense, sparse = dense_mlp(layer), sparse_mlp(layer)
    if dense is not None:
        gate_up, down = _descriptor(dense.gate_up_proj, keep), _descriptor(dense.down_proj, keep)
        if gate_up is None or down is None:
            return False
        slot.gate_up, slot.down, slot.inter = gate_up, down, dense.down_proj.in_features
        return True
    moe = None if sparse is None else _moe(sparse, counts, keep)
    if moe is None:
        return False
    slot.moe = ctypes.pointer(moe)
    return True


def _attention(slot: DecodeLayer, layer: OneCallLayer, keep: Keep) -> bool:
    """The layer's attention into slot; False when a linear has no descriptor."""
    attn = layer.self_attn
    slot.window = attn.sliding_window
    slot.sinks = _ptr(keep.float32(attn.sinks))
    if attn.q_norm is not None and attn.k_norm is not None:
        slot.q_norm = _ptr(keep.float32(attn.q_norm.weight))
        slot.k_norm = _ptr(keep.float32(attn.k_norm.weight))
        slot.qk_norm_whole = int(attn.qk_norm_whole)
    for name, linear_layer in zip(("qkv", "o"), _attention_linears(layer), strict=True):
        desc = _descriptor(linear_layer, keep)
        if desc is None:
            return False
        setattr(slot, name, desc)
    return True


def _layer_table(
    model: OneCallModel, counts: torch.Tensor, keep: Keep
) -> ctypes.Array[DecodeLayer] | None:
    """Every layer's descriptor, in order: the linears' weights as their methods keep them,
    the sparse layers' experts as theirs (counting into counts [layers, E]), the norms'
    weights, the sinks and the biases in float32 (copies in `keep` for a bf16 model); None
    when a part has no descriptor."""
    table = (DecodeLayer * len(model.layers))()
    for i, (slot, layer) in enumerate(zip(table, model.layers, strict=True)):
        slot.input_norm = _ptr(keep.float32(layer.input_layernorm.weight))
        slot.post_norm = _ptr(keep.float32(layer.post_attention_layernorm.weight))
        if not _attention(slot, layer, keep) or not _mlp(slot, layer, counts[i], keep):
            return None
    return table


def _widest_mlp(model: OneCallModel) -> int:
    """decode_forward's `inter`, which sizes its buffers: the widest dense MLP, shared
    expert, or half a router's outputs (each layer's MLP writes at most twice it)."""
    widest = 1
    for layer in model.layers:
        dense, sparse = dense_mlp(layer), sparse_mlp(layer)
        if dense is not None:
            widest = max(widest, dense.down_proj.in_features)
        if sparse is not None:
            widest = max(widest, (sparse.experts.num_experts + 1) // 2)
            if sparse.shared_expert is not None:
                widest = max(widest, sparse.shared_expert.down_proj.in_features)
    return widest


def _num_experts(model: OneCallModel) -> int:
    sparse = [m for m in (sparse_mlp(layer) for layer in model.layers) if m is not None]
    return max((m.experts.num_experts for m in sparse), default=0)


def _weights_key(model: OneCallModel) -> tuple[int, int]:
    """What the descriptors were built from: the first weight and its method (a new key after
    the weights are replaced or LoRA wraps the methods)."""
    qkv = model.layers[0].self_attn.qkv_proj
    return qkv.weight.data_ptr(), id(qkv.method)


class OneCallStep:
    """A model's `one_call_step` (see the module docstring): a decode-only step of at most
    linear.MAX_ROWS sequences (more where every linear is GGUF: _many_rows) through every
    layer in one C call. Holds the layers' descriptors, built once per weights."""

    _table: ctypes.Array[DecodeLayer] | None = None
    _weights_at: tuple[int, int] = (0, 0)
    _widest: int = 1  # _widest_mlp of the bound model
    _many: int = 0  # decode_many_rows of the bound model's table
    _keep: Keep
    _rope: tuple[torch.Tensor, torch.Tensor]
    _counts: torch.Tensor  # [layers, experts] int64: the step's tokens per expert

    def forward(
        self,
        model: OneCallModel,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor | None:
        n = input_ids.shape[0]
        kv_format = model.layers[0].self_attn.backend.kv_format
        dtype = kv_format.dtype  # the model's (a quantized cache stores int8 / fp8 rows)
        if kv_cache.dtype != kv_format.storage_dtype:
            return None
        if (
            meta.num_decodes != meta.num_reqs
            or n > max(linear.MAX_ROWS.get(dtype, 0), self._many_rows(model))
            or not kv_cache.is_contiguous()
        ):
            return None
        x = model.embed_tokens(input_ids).to(torch.float32).contiguous()
        if self._decode(model, x, positions, kv_cache, meta):
            return x.to(dtype)
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def _many_rows(self, model: OneCallModel) -> int:
        """The most rows a step takes where that is more than linear.MAX_ROWS (every linear
        GGUF blocks without LoRA, every layer dense: one_call_step.c's decode_many_rows), else
        0."""
        return 0 if load() is None or self._bind(model) is None else self._many

    def _bind(self, model: OneCallModel) -> ctypes.Array[DecodeLayer] | None:
        """The descriptors of the model's current weights (built again when they change)."""
        key = _weights_key(model)
        if self._table is None or self._weights_at != key:
            self._keep = keep = Keep()
            self._counts = torch.zeros(len(model.layers), _num_experts(model), dtype=torch.int64)
            self._table = table = _layer_table(model, self._counts, keep)
            self._weights_at = key
            lib = load()
            self._many = (
                0 if lib is None or table is None else lib.decode_many_rows(table, len(table))
            )
            self._widest = _widest_mlp(model)
            cos, sin = (keep.float32(t) for t in model.rotary.tables())
            assert cos is not None and sin is not None
            self._rope = cos, sin
        return self._table

    def _decode(
        self,
        model: OneCallModel,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> bool:
        """All layers over x in place; False (x untouched or the step redone by the caller)
        when the kernel refuses."""
        lib = load()
        kv_format = model.layers[0].self_attn.backend.kv_format
        if lib is None or kv_format.dtype not in (torch.float32, torch.bfloat16):
            return False
        table = self._bind(model)
        if table is None:
            return False
        layer = model.layers[0]
        attn = layer.self_attn
        cos, sin = self._rope
        tables, lens = meta.block_tables, meta.seq_lens
        assert tables.dtype == torch.int32 and lens.dtype == torch.int32
        slots, pos = meta.slot_mapping, positions.to(torch.int64).contiguous()
        n, hidden = x.shape
        self._counts.zero_()
        lora, lora_slots = self._keep.lora, None
        if lora is not None and lora.active:
            assert lora.num_tokens == n, "the LoRA mapping is not this step's"
            lora_slots = lora.buffer.data_ptr()
        groups = None  # KV layer groups: each layer its slot, its group's tables and slots
        if meta.group_metas:
            kv_slot, kv_group = model.kv_slot, model.kv_group
            views = []
            for m in meta.group_metas:
                assert m.block_tables.dtype == torch.int32 and m.block_tables.is_contiguous()
                assert m.slot_mapping.dtype == torch.int64 and m.slot_mapping.is_contiguous()
                views.append(
                    (m.block_tables.data_ptr(), m.block_tables.stride(0), m.slot_mapping.data_ptr())
                )
            rows = [(kv_slot[i], *views[kv_group[i]]) for i in range(len(model.layers))]
            groups = torch.tensor(rows, dtype=torch.int64)
        code = lib.decode_forward(
            table,
            len(model.layers),
            x.data_ptr(),
            n,
            hidden,
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
            2 * cos.shape[1],  # the rotated dims: the tables' width (partial rotary)
            self._widest,
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
            attn.backend.scale,
            kv_format.kind,  # float32, bf16, or a quantized row (kv_quant.py)
            lora_slots,
            torch.get_num_threads(),
            groups.data_ptr() if groups is not None else None,
        )
        if code != 0:
            return False
        self._count_tokens(model)
        return True

    def _count_tokens(self, model: OneCallModel) -> None:
        """The step's tokens per expert into each sparse layer's counters (as its layer
        counts them)."""
        if self._counts.shape[1] == 0:
            return
        for layer, counts in zip(model.layers, self._counts.tolist(), strict=True):
            sparse = sparse_mlp(layer)
            if sparse is not None:
                sparse.experts.count_tokens(counts[: sparse.experts.num_experts])


def can_use(model: OneCallModel) -> bool:
    """Whether `model` is of the shape one_call_step.c takes (see the module docstring)."""
    if model.tp.size != 1 or not _one_float_dtype(model) or not model.rotary.is_neox_style:
        return False
    for layer in model.layers:
        attn = layer.self_attn
        if not attn.backend.cpu_decode_kernel:
            return False
        norms = (attn.q_norm, attn.k_norm)
        if any(n is not None and n.offset != 0 for n in norms):  # Gemma's (1 + weight)
            return False
    counts = torch.zeros(len(model.layers), _num_experts(model), dtype=torch.int64)
    return _layer_table(model, counts, Keep()) is not None


def _one_float_dtype(model: OneCallModel) -> bool:
    """Every float parameter float32, or every one bfloat16 (quantized weights aside): the
    models the kernels take."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    return dtypes in ({torch.float32}, {torch.bfloat16})


def one_call_step_for(model: OneCallModel) -> OneCallStep | None:
    """The one-call step for `model`, or None when it is not of a shape the kernel takes or
    the library cannot be had."""
    if not can_use(model) or load() is None:
        return None
    return OneCallStep()
