"""What the MoE methods whose CPU kernel is moe.c share (gpu_worker/cpu/moe.py): routing by
moe.c, the whole layer in one C call where the method's descriptor takes it, and the stacked
weights as that descriptor."""

from __future__ import annotations

import torch

from gpu_worker.cpu import moe as cpu_moe
from gpu_worker.cpu.moe import MoEExperts
from gpu_worker.cpu.one_call_descriptors import Keep
from gpu_worker.layers.fused_moe import FusedMoE, grouped_experts
from gpu_worker.layers.moe_routing import select_experts


class CKernelExperts:
    """What a method whose "cpu" kernel is moe.c shares (gpu_worker/cpu/moe.py): routing by
    moe.c, and the whole layer in one C call where its `one_call_experts` descriptor takes it
    (float32 activations), else `grouped_experts` over its own projections. The one-call
    step calls the same C functions, so both give a token the same bits."""

    def one_call_experts(self, layer: FusedMoE, keep: Keep) -> MoEExperts | None:
        raise NotImplementedError

    def gate_up(self, layer: FusedMoE, expert: int, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def down(self, layer: FusedMoE, expert: int, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def select_experts(
        self, layer: FusedMoE, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        r = layer.routing
        if self._runs_moe_c():
            done = cpu_moe.route(logits, r.top_k, r.scoring, r.renormalize)
            if done is not None:
                return done
        return select_experts(logits, r)

    def apply(
        self, layer: FusedMoE, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        if x.dtype == torch.float32 and self._runs_moe_c():
            keep = Keep()  # alive through the call: the descriptor may point at its copies
            desc = self.one_call_experts(layer, keep)
            done = None if desc is None else cpu_moe.experts(desc, x, ids, weights)
            if done is not None:
                y, counts = done
                layer.count_tokens(counts)
                return y
        return grouped_experts(self, layer, x, weights, ids)

    def _runs_moe_c(self) -> bool:
        """Whether the method's kernel is moe.c's (its "cpu" kernel)."""
        raise NotImplementedError


def moe_c_experts(
    layer: FusedMoE,
    kind: int,
    keep: Keep,
    *,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    qtypes: tuple[int, int] = (0, 0),
) -> MoEExperts | None:
    """The layer's stacked w13 / w2 weights as moe.c's descriptor of `kind`, with its biases
    (float32, copies in `keep` where they are not) and activation."""
    return cpu_moe.experts_desc(
        kind,
        layer.w13_weight,
        layer.w2_weight,
        layer.width,
        layer.hidden_size,
        scales=scales,
        qtypes=qtypes,
        biases=(keep.float32(layer.w13_bias), keep.float32(layer.w2_bias)),
        activation=layer.activation,
        limit=layer.swiglu_limit,
        alpha=layer.swiglu_alpha,
    )


class ProjectedExperts(CKernelExperts):
    """What a method whose experts are stored per projection shares: gate_up and down are
    its `_project` of the stacked "w13" / "w2" weights, the layer runs moe.c or
    grouped_experts (CKernelExperts), and nothing is resident beside the weights."""

    kernel: str

    def _runs_moe_c(self) -> bool:
        return self.kernel == "cpu"

    def _project(self, layer: FusedMoE, prefix: str, expert: int, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def gate_up(self, layer: FusedMoE, expert: int, x: torch.Tensor) -> torch.Tensor:
        return self._project(layer, "w13", expert, x)

    def down(self, layer: FusedMoE, expert: int, x: torch.Tensor) -> torch.Tensor:
        return self._project(layer, "w2", expert, x)

    def extra_bytes(self, layer: FusedMoE) -> int:
        return 0
