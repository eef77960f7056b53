"""GGUF block-quantized experts (llama.cpp's 3-D ffn_{gate,up,down}_exps), kept as the file
stores them and multiplied by the GGUF linear kernels (gpu_worker/layers/linear_methods/gguf.py):
an expert's bytes are read only when a token selects it.

The layer keeps each shard's bytes stacked over the experts, uint8 [E, rows, row_bytes]:
`w13_weight` (gate then up; `w13_weight_1` when up's type differs from gate's) and `w2_weight`.
The "torch" kernel dequantizes them once at load to float [E, out, in] (the reference). The
"cpu" kernel runs the whole layer in one C call (gpu_worker/cpu/moe.py: routing, grouping,
gguf.c's kernels, activation, weighted sum; the one-call step runs the same) where it takes
the layer (one block type per projection), else loops over the experts in Python with the
same kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu_worker.cpu import moe as cpu_moe
from gpu_worker.cpu.moe import MoEExperts
from gpu_worker.cpu.one_call_descriptors import Keep
from gpu_worker.layers.fused_moe import ExpertWeights, FusedMoE, check_shape
from gpu_worker.layers.linear import set_parameter
from gpu_worker.layers.linear_methods.gguf import _shard_matmul, dequantize_weight, shard_names
from gpu_worker.layers.linear_methods.weights import CheckpointWeight, GGUFWeight
from gpu_worker.layers.moe_methods.c_kernel import ProjectedExperts, moe_c_experts


def _gguf(parts: list[CheckpointWeight], what: str) -> list[GGUFWeight]:
    out = [p for p in parts if isinstance(p, GGUFWeight)]
    if len(out) != len(parts):
        raise TypeError(f"the gguf MoE method takes GGUF {what} experts, got {type(parts[0])}")
    layout = {(tuple(s.qtype for s in w.shards), tuple(s.rows for s in w.shards)) for w in out}
    if len(layout) != 1:
        raise ValueError(f"GGUF {what} experts differ in their block types or rows: {layout}")
    return out


class GGUFMoEMethod(ProjectedExperts):
    """GGUF experts (see the module docstring); one instance per layer."""

    name = "gguf"

    def __init__(self, kernel: str, dtype: torch.dtype) -> None:
        self._matmul = _shard_matmul(kernel)
        self.kernel = kernel
        self.dtype = dtype
        # per projection ("w13", "w2"): the shards' types and rows
        self.qtypes: dict[str, tuple[int, ...]] = {}
        self.rows: dict[str, tuple[int, ...]] = {}

    def load_weights(self, layer: FusedMoE, experts: ExpertWeights) -> None:
        for prefix, parts, what in (
            ("w13", experts.gate_up, "gate/up"),
            ("w2", experts.down, "down"),
        ):
            weights = _gguf(parts, what)
            first = weights[0]
            check_shape(
                layer, f"{prefix}_weight", (len(weights), first.out_features, first.in_features)
            )
            self.qtypes[prefix] = tuple(s.qtype for s in first.shards)
            self.rows[prefix] = tuple(s.rows for s in first.shards)
            if self._matmul is None:  # the reference: float experts
                w = torch.stack([dequantize_weight(x) for x in weights]).to(self.dtype)
                set_parameter(layer, f"{prefix}_weight", w)
                continue
            for i, name in enumerate(shard_names(len(first.shards))):
                stacked = torch.stack([w.shards[i].data for w in weights]).contiguous()
                set_parameter(layer, f"{prefix}_{name}", stacked)
        set_parameter(layer, "w13_bias", experts.gate_up_bias)
        set_parameter(layer, "w2_bias", experts.down_bias)

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        pass

    def one_call_experts(self, layer: FusedMoE, keep: Keep) -> MoEExperts | None:
        # moe.c runs gguf.c's arithmetic on one block type per projection
        if self.kernel != "cpu" or any(len(q) != 1 for q in self.qtypes.values()):
            return None
        qtypes = (self.qtypes["w13"][0], self.qtypes["w2"][0])
        return moe_c_experts(layer, cpu_moe.KIND_GGUF, keep, qtypes=qtypes)

    def _project(self, layer: FusedMoE, prefix: str, expert: int, x: torch.Tensor) -> torch.Tensor:
        bias = (
            layer.get_parameter(f"{prefix}_bias")
            if getattr(layer, f"{prefix}_bias") is not None
            else None
        )
        b = None if bias is None else bias[expert]
        matmul = self._matmul
        if matmul is None:
            return F.linear(x, layer.get_parameter(f"{prefix}_weight")[expert], b)
        n_in = layer.hidden_size if prefix == "w13" else layer.width
        names = shard_names(len(self.qtypes[prefix]))
        parts = [
            matmul(x, layer.get_parameter(f"{prefix}_{name}")[expert], q, rows, n_in)
            for name, q, rows in zip(names, self.qtypes[prefix], self.rows[prefix], strict=True)
        ]
        y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        return y if b is None else y + b

    @property
    def storage(self) -> str:
        from gguf import GGMLQuantizationType

        types = {GGMLQuantizationType(q).name for qs in self.qtypes.values() for q in qs}
        return "gguf:" + "+".join(sorted(types))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.storage.removeprefix('gguf:')}, kernel={self.kernel})"
