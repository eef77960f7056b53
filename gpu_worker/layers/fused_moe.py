"""The mixture-of-experts layer, and the method object that decides how its experts' weights
are kept and multiplied.

A sparse MLP block (gpu_worker/models/moe.py) runs its router, a `Linear` to one logit per
expert, and hands the logits to `FusedMoE`, which

    1. selects each token's top-k experts and their weights (`select_experts`, as the family
       defines it: softmax then top-k, renormalised or not; or top-k of the logits, then a
       softmax over them; gpu_worker/layers/moe_routing.py, with steps 2 and 4);
    2. groups the step's (token, slot) pairs by expert: a stable counting sort of the expert
       ids, so an expert's rows keep the tokens' order;
    3. runs each selected expert's rows through its gate/up projection, the activation and
       its down projection (`method.gate_up`, `method.down`: the weight's own kernel);
    4. adds each token's expert outputs, times their weights, in increasing expert id order,
       starting from zero (transformers' order of additions).

Grouping never changes a row's arithmetic: every kernel the methods call gives a row the same
bits whatever other rows share its call (the CPU float method's GEMM keeps one order of
operations per output; GGUF and int8 quantize activations per row), and step 4's sum is per
token. So a token's output is the same bits
alone or in any batch; only `FloatMoEMethod` (torch's GEMM, the reference and the CUDA path)
leaves that to torch.

The methods (one per layer, chosen once at load from the checkpoint's expert weights and the
kernels this process runs, gpu_worker/layers/moe_methods/) follow `Linear`'s pattern:

    method.load_weights(layer, experts)           the checkpoint's per-expert tensors
    method.process_weights_after_loading(layer)
    method.select_experts(layer, logits)          step 1 (torch, or moe.c's for a C method)
    method.gate_up(layer, e, x) / .down(...)      expert e's projections of rows x
    method.apply(layer, x, weights, ids)          the whole layer (`grouped_experts`, or
                                                  moe.c's one call: moe_methods/c_kernel.py)
    method.one_call_experts(layer, keep)          the experts as moe.c reads them (the CPU's
                                                  one-call step runs the same), or None

`FusedMoE.tokens_per_expert` counts the (token, expert) pairs each expert has computed since
load: the routing skew an operator sees in /admin/stats and /metrics.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.cpu.moe import MoEExperts
from gpu_worker.cpu.one_call_descriptors import Keep
from gpu_worker.layers.linear import set_parameter
from gpu_worker.layers.linear_methods.weights import CheckpointWeight
from gpu_worker.layers.moe_routing import Routing, combine, group_by_expert, select_experts
from gpu_worker.layers.ops import TORCH_OPS, LayerOps

ACTIVATIONS = ("silu", "swiglu_clamp")


@dataclasses.dataclass(frozen=True)
class ExpertWeights:
    """A MoE layer's experts as the checkpoint gives them: per expert, the gate/up weight
    (gate rows then up rows, a fused weight, gpu_worker/layers/linear_methods/weights.py) and
    the down weight, with their biases where the family has them (gpt-oss)."""

    gate_up: list[CheckpointWeight]
    down: list[CheckpointWeight]
    gate_up_bias: torch.Tensor | None = None  # [E, 2 * width]
    down_bias: torch.Tensor | None = None  # [E, hidden]

    @property
    def num_experts(self) -> int:
        return len(self.gate_up)


class MoEMethod(Protocol):
    """How one MoE layer's experts are stored and multiplied (see the module docstring)."""

    name: str

    def load_weights(self, layer: FusedMoE, experts: ExpertWeights) -> None: ...

    def process_weights_after_loading(self, layer: FusedMoE) -> None: ...

    def select_experts(
        self, layer: FusedMoE, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]) from router logits [T, E], by the layer's
        routing: `select_experts` (torch), or moe.c's where the method's experts are
        (the one-call step routes so too)."""
        ...

    def one_call_experts(self, layer: FusedMoE, keep: Keep) -> MoEExperts | None:
        """The experts as moe.c reads them (the one-call step's, and the layer's own C call),
        or None when moe.c does not run this method's arithmetic. Tensors made for the
        descriptor go to `keep`, which outlives it."""
        ...

    def gate_up(self, layer: FusedMoE, expert: int, x: torch.Tensor) -> torch.Tensor:
        """x [rows, hidden] @ expert's gate/up weight.T (+ bias): [rows, 2 * width]."""
        ...

    def down(self, layer: FusedMoE, expert: int, x: torch.Tensor) -> torch.Tensor:
        """x [rows, width] @ expert's down weight.T (+ bias): [rows, hidden]."""
        ...

    def apply(
        self, layer: FusedMoE, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """The layer's output [T, hidden] for x [T, hidden] routed to `ids` with `weights`."""
        ...

    def extra_bytes(self, layer: FusedMoE) -> int: ...

    @property
    def storage(self) -> str:
        """How the experts are stored: "" (float), "int8", "gguf:<types>", "mxfp4"."""
        ...


class ExpertProjections(Protocol):
    """What grouped_experts needs of a method: each expert's two projections."""

    def gate_up(self, layer: FusedMoE, expert: int, x: torch.Tensor) -> torch.Tensor: ...

    def down(self, layer: FusedMoE, expert: int, x: torch.Tensor) -> torch.Tensor: ...


def grouped_experts(
    method: ExpertProjections,
    layer: FusedMoE,
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """Steps 2-4 of the module docstring with `method`'s projections: each selected expert's
    rows (in token order) through gate/up, the activation and down, then the weighted sum."""
    num_tokens, top_k = ids.shape
    order, counts = group_by_expert(ids, layer.num_experts)
    layer.count_tokens(counts)
    out = x.new_empty(num_tokens * top_k, layer.hidden_size)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start : start + n]
        start += n
        h = layer.activate(method.gate_up(layer, expert, x[pairs // top_k]))
        out[pairs] = method.down(layer, expert, h)
    return combine(out.view(num_tokens, top_k, -1), weights, ids, x.dtype)


class FusedMoE(nn.Module):
    """num_experts SwiGLU experts [hidden -> width -> hidden] and the routing among them, by
    `self.method` (see the module docstring); forward(x [T, hidden], router logits [T, E]).

    Built (on "meta", by the loader) with float weights of the layer's shape, gate|up fused:
    `w13_weight` [E, 2 * width, hidden] and `w2_weight` [E, hidden, width]; the method then
    takes the checkpoint's experts and may keep them in another form (GGUF blocks, int8)."""

    w13_weight: torch.Tensor
    w2_weight: torch.Tensor
    w13_bias: torch.Tensor | None
    w2_bias: torch.Tensor | None

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        width: int,
        routing: Routing,
        *,
        activation: str = "silu",
        bias: bool = False,
        swiglu_limit: float = 7.0,
        swiglu_alpha: float = 1.702,
        ops: LayerOps = TORCH_OPS,
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"expert activation {activation!r} is not one of {ACTIVATIONS}")
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.width = width
        self.routing = routing
        self.activation = activation
        self.swiglu_limit = swiglu_limit
        self.swiglu_alpha = swiglu_alpha
        self.ops = ops
        set_parameter(self, "w13_weight", torch.empty(num_experts, 2 * width, hidden_size))
        set_parameter(self, "w2_weight", torch.empty(num_experts, hidden_size, width))
        set_parameter(self, "w13_bias", torch.empty(num_experts, 2 * width) if bias else None)
        set_parameter(self, "w2_bias", torch.empty(num_experts, hidden_size) if bias else None)
        self.method: MoEMethod = FloatMoEMethod()
        # (token, expert) pairs computed per expert since load; not a parameter or buffer
        self.tokens_per_expert = [0] * num_experts

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = self.method.select_experts(self, router_logits)
        return self.method.apply(self, x, weights, ids)

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The activation of one expert's gate/up rows [rows, 2 * width] -> [rows, width]:
        silu(gate) * up, by the layer ops (gate|up halves); or gpt-oss's clamped SwiGLU on
        interleaved gate/up columns (the checkpoint's layout, kept by the loader)."""
        if self.activation == "silu":
            return self.ops.silu_mul(gate_up)
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=self.swiglu_limit)
        up = up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
        glu = gate * torch.sigmoid(gate * self.swiglu_alpha)
        return (up + 1) * glu

    def count_tokens(self, counts: list[int]) -> None:
        for e, n in enumerate(counts):
            self.tokens_per_expert[e] += n

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, hidden={self.hidden_size}, width={self.width}, "
            f"top_k={self.routing.top_k}, {self.method!r}"
        )


# each model's MoE layers, found once: walking a model's modules every step cost ~1 ms of a
# 2-core Zen 4's ~8 ms decode step (a module tree is fixed once the model is loaded)
_MOE_LAYERS: weakref.WeakKeyDictionary[nn.Module, list[FusedMoE]] = weakref.WeakKeyDictionary()


def take_tokens_per_expert(model: nn.Module) -> list[int]:
    """The (token, expert) pairs each expert computed since the last call, summed over the
    model's MoE layers (empty for a dense model); the layers' counters restart at zero."""
    layers = _MOE_LAYERS.get(model)
    if layers is None:
        layers = _MOE_LAYERS[model] = [m for m in model.modules() if isinstance(m, FusedMoE)]
    total: list[int] = []
    for layer in layers:
        total = add_counts(total, layer.tokens_per_expert)
        layer.tokens_per_expert = [0] * layer.num_experts
    return total


def add_counts(a: list[int], b: list[int]) -> list[int]:
    """Elementwise a + b; an empty list is zeros (models of different expert counts: the
    longer list, the shorter added to its first entries)."""
    longer, shorter = (a, b) if len(a) >= len(b) else (b, a)
    return [n + (shorter[i] if i < len(shorter) else 0) for i, n in enumerate(longer)]


def stack_float(parts: list[CheckpointWeight], what: str) -> torch.Tensor:
    """Per-expert float weights [out, in] as one tensor [E, out, in]."""
    tensors = [p for p in parts if isinstance(p, torch.Tensor)]
    if len(tensors) != len(parts):
        raise TypeError(f"a float MoE method takes float {what} weights, got {type(parts[0])}")
    return torch.stack(tensors).contiguous()


def check_shape(layer: FusedMoE, name: str, got: tuple[int, ...]) -> None:
    want = tuple(layer.get_parameter(name).shape)
    if got != want:
        raise ValueError(f"MoE {name} {list(got)} does not fit a layer {list(want)}")


class TorchRouting:
    """The routing and layer of a method moe.c does not run: torch's select_experts, no
    descriptor."""

    def select_experts(
        self, layer: FusedMoE, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return select_experts(logits, layer.routing)

    def one_call_experts(self, layer: FusedMoE, keep: Keep) -> MoEExperts | None:
        return None


class FloatMoEMethod(TorchRouting):
    """Float experts [E, out, in] multiplied by torch (`F.linear` per expert group): the
    reference everywhere, the method on CUDA and for the torch-only CPU path."""

    name = "float"

    def load_weights(self, layer: FusedMoE, experts: ExpertWeights) -> None:
        w13 = stack_float(experts.gate_up, "gate/up")
        w2 = stack_float(experts.down, "down")
        check_shape(layer, "w13_weight", tuple(w13.shape))
        check_shape(layer, "w2_weight", tuple(w2.shape))
        set_parameter(layer, "w13_weight", w13)
        set_parameter(layer, "w2_weight", w2)
        set_parameter(layer, "w13_bias", experts.gate_up_bias)
        set_parameter(layer, "w2_bias", experts.down_bias)

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        pass

    def gate_up(self, layer: FusedMoE, expert: int, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.w13_weight[expert], _bias(layer.w13_bias, expert))

    def down(self, layer: FusedMoE, expert: int, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.w2_weight[expert], _bias(layer.w2_bias, expert))

    def apply(
        self, layer: FusedMoE, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        return grouped_experts(self, layer, x, weights, ids)

    def extra_bytes(self, layer: FusedMoE) -> int:
        return 0

    storage = ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _bias(bias: torch.Tensor | None, expert: int) -> torch.Tensor | None:
    return None if bias is None else bias[expert]
