"""The model's linear layer, and the method object that decides how its weight is kept and used.

Every linear layer of the model is a `Linear` whose `method` is chosen once, at load, from the
checkpoint's weight (float, GGUF blocks, int8) and the kernels this process runs (torch, the
CPU C kernels, Triton) — vLLM's `quant_method` shape:

    method.load_weights(layer, weight, bias)     the checkpoint's tensors onto the layer
    method.process_weights_after_loading(layer)  pack or re-lay them once (oneDNN blocks, ...)
    method.apply(layer, x)                       y = x @ W.T + b, every forward
    method.one_call_linear(layer, keep)          its descriptor for the CPU's one-call step
                                                 (gpu_worker/cpu/one_call_step.py), or None

The model code names no kernel: it calls `layer(x)`. What runs is `layer.method`, visible
when the model is printed. The other methods live in gpu_worker/layers/linear_methods/ (CPU
float, GGUF, int8) and gpu_worker/lora/layer.py (LoRA around any of them), each binding its
kernel function once, when it is built; `FloatLinearMethod` here is plain torch, the reference
and the GPU path.

A method takes the checkpoint's tensors where they were read; the loader moves the layer
(everything `load_weights` registered on it) to the model's device before
`process_weights_after_loading`, so a method never places a tensor itself, and whatever it
derives after loading (a packed copy) is made from the placed weight.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.cpu.one_call_descriptors import DecodeLinear, Keep
from gpu_worker.layers.linear_methods.weights import CheckpointWeight


class LinearMethod(Protocol):
    """How one linear layer's weight is stored and multiplied (see the module docstring)."""

    name: str

    def load_weights(
        self, layer: Linear, weight: CheckpointWeight, bias: torch.Tensor | None
    ) -> None: ...

    def process_weights_after_loading(self, layer: Linear) -> None: ...

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor: ...

    def one_call_linear(self, layer: Linear, keep: Keep) -> DecodeLinear | None:
        """The layer's weight (and LoRA slots) as the one-call step's C loop reads them, bias
        aside (the step adds it); None when the loop cannot run this method's arithmetic.
        Tensors made for the descriptor go to `keep`, which outlives it."""
        ...

    def extra_bytes(self, layer: Linear) -> int:
        """Bytes the method keeps beside the layer's parameters (a packed copy), 0 if none."""
        ...

    @property
    def storage(self) -> str:
        """How the weight is stored: "" (float), "int8", "gguf:<types>"."""
        ...


def set_parameter(layer: nn.Module, name: str, tensor: torch.Tensor | None) -> None:
    """Register `tensor` as the layer's frozen parameter `name` (None: no such parameter)."""
    if tensor is None:
        layer.register_parameter(name, None)
    else:
        layer.register_parameter(name, nn.Parameter(tensor, requires_grad=False))


class FloatLinearMethod:
    """A float weight [out, in] multiplied by torch (`F.linear`): the reference everywhere,
    the method on CUDA (cuBLAS) and for the torch-only CPU path."""

    name = "float"

    def load_weights(
        self, layer: Linear, weight: CheckpointWeight, bias: torch.Tensor | None
    ) -> None:
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"{self.name} linear method takes a float tensor, got {weight!r}")
        set_parameter(layer, "weight", weight)
        set_parameter(layer, "bias", bias)

    def process_weights_after_loading(self, layer: Linear) -> None:
        pass

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)

    def one_call_linear(self, layer: Linear, keep: Keep) -> DecodeLinear | None:
        return None  # torch's arithmetic, not the C loop's

    def extra_bytes(self, layer: Linear) -> int:
        return 0

    storage = ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Linear(nn.Module):
    """y = x @ W.T + b over the last dimension of x, by `self.method`.

    Built (on the "meta" device, by the loader) with a float weight of the layer's shape so
    the model's structure is complete; the loader then gives each layer its method and the
    checkpoint's tensors (`method.load_weights`), which may replace `weight` by another
    representation (GGUF blocks, int8 and scales)."""

    weight: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        set_parameter(self, "weight", torch.empty(out_features, in_features))
        set_parameter(self, "bias", torch.empty(out_features) if bias else None)
        # nn.Linear's initialisation (a no-op on "meta", where the loader builds models), so a
        # layer built outside the loader (a test's module) holds numbers, not garbage
        nn.Linear.reset_parameters(self)  # type: ignore[arg-type]  # reads weight/bias only
        self.method: LinearMethod = FloatLinearMethod()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def one_call_linear(self, keep: Keep) -> DecodeLinear | None:
        """This layer's descriptor for the one-call step, by its method."""
        return self.method.one_call_linear(self, keep)

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in={self.in_features}, out={self.out_features}, bias={bias}, {self.method!r}"


def resident_weight_bytes(model: nn.Module) -> int:
    """The bytes a model's weights hold in memory: every parameter once (a tied weight is
    one), plus what the linear methods keep beside them (oneDNN's packed copies)."""
    seen: dict[int, int] = {}
    for p in model.parameters():
        seen.setdefault(p.data_ptr(), p.numel() * p.element_size())
    extra = sum(m.method.extra_bytes(m) for m in model.modules() if isinstance(m, Linear))
    return sum(seen.values()) + extra


def quantization_of(model: nn.Module) -> str:
    """How the model's linears are stored: "" (float), "int8", or "gguf:" with the GGUF
    types in use (the LM head's among them)."""
    names = sorted({m.method.storage for m in model.modules() if isinstance(m, Linear)} - {""})
    gguf = [n.removeprefix("gguf:") for n in names if n.startswith("gguf:")]
    other = [n for n in names if not n.startswith("gguf:")]
    types = sorted({t for g in gguf for t in g.split("+")})
    return ",".join(other + ([f"gguf:{'+'.join(types)}"] if types else []))
